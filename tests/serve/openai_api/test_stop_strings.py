"""Stop strings through the OpenAI API of the package's server (conftest.py): the text ends
before the stop string, which no streamed chunk ever shows, for completions (n=2 too) and chat;
and the most stop work a request may ask for still finishes."""

from __future__ import annotations

import pytest

from .conftest import Collected, chat, complete, find_stop


def test_stop_string_json(client, stop_case):
    prompt, full, stop, expected = stop_case
    r = complete(client, prompt, 40, stop=stop)
    choice = r.choices[0]
    assert choice.text == expected and stop not in choice.text
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop
    assert r.usage.completion_tokens < 40
    # Among several stop strings the one that occurs wins.
    r2 = complete(client, prompt, 40, stop=["\x7f\x7f\x7f\x7f", stop])
    assert r2.choices[0].text == expected and r2.choices[0].finish_reason == "stop"


def test_stop_string_stream_never_leaks(client, stop_case):
    prompt, full, stop, expected = stop_case
    got = Collected(complete(client, prompt, 40, stop=[stop], stream=True,
                             stream_options={"include_usage": True}), chat=False)
    assert got.text == {0: expected}
    assert got.finish == {0: ["stop"]}
    pieces = [c.choices[0].text for c in got.chunks if c.choices]
    for k in range(len(pieces)):  # no prefix of the stream ever shows the stop string
        assert stop not in "".join(pieces[: k + 1])
    assert got.usage.completion_tokens < 40
    # With n=2 both choices stop at the same place.
    got2 = Collected(complete(client, prompt, 40, stop=stop, n=2, stream=True), chat=False)
    assert got2.text == {0: expected, 1: expected}
    assert got2.finish == {0: ["stop"], 1: ["stop"]}


def test_stop_string_chat(client):
    full = chat(client, max_tokens=40).choices[0].message.content
    found = find_stop(full)
    if found is None:
        pytest.fail(f"the greedy chat answer {full!r} has no printable piece to stop at")
    stop, i = found
    r = chat(client, max_tokens=40, stop=stop)
    assert r.choices[0].message.content == full[:i]
    assert r.choices[0].finish_reason == "stop"
    got = Collected(chat(client, max_tokens=40, stop=stop, stream=True), chat=True)
    assert got.text == {0: full[:i]} and got.finish == {0: ["stop"]}


def test_sixty_four_long_stop_strings_with_n4_over_400_tokens_finish(client):
    """The most stop work a request may ask for: each new token is matched only in the window
    it can complete (the matcher's unit test counts the characters)."""
    stops = [f"{i:02d}" + "\u2603" * 1022 for i in range(64)]  # 1,024 characters, never made
    r = complete(client, [5, 17, 42, 99], 400, n=4, stop=stops, temperature=1.0, seed=3)
    assert [c.finish_reason for c in r.choices] == ["length"] * 4
    assert r.usage.completion_tokens == 4 * 400

"""Chat completions through the OpenAI API of the package's server (conftest.py): whole and
streamed (the role first), usage after the chat template, n and logprobs."""

from __future__ import annotations

import pytest

from .conftest import MESSAGES, MODEL, Collected, assert_usage, chat, chat_prompt_len


def test_chat_json(client, tiny_tokenizer):
    r = chat(client, max_tokens=12)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert_usage(r.usage, chat_prompt_len(tiny_tokenizer, MESSAGES), 12)


def test_chat_stream_matches_json(client, tiny_tokenizer):
    whole = chat(client, max_tokens=20)
    got = Collected(chat(client, max_tokens=20, stream=True,
                         stream_options={"include_usage": True}), chat=True)
    first = got.chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.index == 0
    assert all(c.object == "chat.completion.chunk" for c in got.chunks)
    assert got.text == {0: whole.choices[0].message.content}
    assert got.finish == {0: ["length"]}
    assert_usage(got.usage, chat_prompt_len(tiny_tokenizer, MESSAGES), 20)


def test_chat_n2(client):
    r = chat(client, max_tokens=7, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens == 14
    got = Collected(chat(client, max_tokens=7, n=2, stream=True,
                         stream_options={"include_usage": True}), chat=True)
    assert got.finish == {0: ["length"], 1: ["length"]}
    assert got.text == {0: r.choices[0].message.content, 1: r.choices[1].message.content}
    assert got.usage.completion_tokens == 14


def test_chat_logprobs(client):
    n_top = 4
    r = chat(client, max_tokens=10, logprobs=True, top_logprobs=n_top)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0.0
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        assert len(entry.top_logprobs) == n_top
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)
    # Without logprobs there are none.
    assert chat(client, max_tokens=3).choices[0].logprobs is None
    # top_logprobs=0: the sampled token only.
    r0 = chat(client, max_tokens=10, logprobs=True, top_logprobs=0)
    assert all(e.top_logprobs == [] for e in r0.choices[0].logprobs.content)
    assert [e.logprob for e in r0.choices[0].logprobs.content] == pytest.approx(
        [e.logprob for e in content], abs=1e-5)
    # Streamed: the same entries, in order.
    got = Collected(chat(client, max_tokens=10, logprobs=True, top_logprobs=n_top, stream=True),
                    chat=True)
    assert [e.logprob for e in got.logprobs[0]] == pytest.approx([e.logprob for e in content],
                                                                 abs=1e-5)
    assert [e.token for e in got.logprobs[0]] == [e.token for e in content]

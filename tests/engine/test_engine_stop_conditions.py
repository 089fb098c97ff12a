"""The offline engine's stop conditions (test_engine.py's engine and helpers): stop strings cut
the text before them (or keep them when asked), stop token ids, EOS unless ignored, and
max_tokens or max_model_len ending a request with "length"."""

from __future__ import annotations

import pytest

from parashift import SamplingParams

from .test_engine import (  # noqa: F401 (_check_no_leaks: the autouse check after each test)
    MAX_MODEL_LEN,
    _check_no_leaks,
    greedy,
    random_prompts,
)

PROMPTS_TEXT = ["Hello world, this is a test", "The quick brown fox", "abc", "Once upon a time"]


def find_printable_stop(text: str) -> str | None:
    """A two-character ASCII stop string that occurs in `text` after its first character."""
    for i in range(1, len(text) - 1):
        s = text[i : i + 2]
        if s.isascii() and s.isprintable():
            return s
    return None


def test_stop_string_cuts_text_before_it(llm):
    for prompt in PROMPTS_TEXT:
        (full,) = llm.generate(prompt, greedy(32), use_tqdm=False)
        stop = find_printable_stop(full.outputs[0].text)
        if stop is not None:
            break
    else:
        pytest.fail("no generated text holds a printable stop string")
    text, ids = full.outputs[0].text, full.outputs[0].token_ids
    cut = text.find(stop)

    (out,) = llm.generate(prompt, greedy(32, stop=["never-generated", stop]), use_tqdm=False)
    c = out.outputs[0]
    assert c.text == text[:cut]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert 0 < len(c.token_ids) < len(ids) and c.token_ids == ids[: len(c.token_ids)]

    (kept,) = llm.generate(prompt, greedy(32, stop=stop, include_stop_str_in_output=True),
                           use_tqdm=False)
    assert kept.outputs[0].text == text[: cut + len(stop)]
    assert kept.outputs[0].token_ids == c.token_ids


def test_stop_string_on_last_allowed_token_reports_stop(llm):
    prompt = PROMPTS_TEXT[0]
    (full,) = llm.generate(prompt, greedy(32), use_tqdm=False)
    stop = find_printable_stop(full.outputs[0].text)
    assert stop is not None
    (first,) = llm.generate(prompt, greedy(32, stop=stop), use_tqdm=False)
    num_tokens = len(first.outputs[0].token_ids)  # the token that completes the stop string
    (out,) = llm.generate(prompt, greedy(num_tokens, stop=stop), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == first.outputs[0].token_ids and c.text == first.outputs[0].text
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)


def test_stop_token_ids(llm):
    (prompt,) = random_prompts([15], seed=20)
    (full,) = llm.generate([prompt], greedy(24), use_tqdm=False)
    ids = full.outputs[0].token_ids
    stop_token = ids[6]
    end = ids.index(stop_token) + 1
    (out,) = llm.generate([prompt], greedy(24, stop_token_ids=[stop_token]), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ids[:end]
    assert c.finish_reason == "stop" and c.stop_reason == stop_token


def test_eos_stops_unless_ignored(llm):
    eos = llm.eos_token_id
    for prompt in PROMPTS_TEXT:
        (full,) = llm.generate(prompt, greedy(48), use_tqdm=False)
        if eos in full.outputs[0].token_ids:
            break
    else:
        pytest.fail("the tiny model never produced EOS for any test prompt")
    ids = full.outputs[0].token_ids
    end = ids.index(eos) + 1
    assert full.outputs[0].finish_reason == "length" and len(ids) == 48

    (out,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48),
                          use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ids[:end]
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert "</s>" not in c.text  # special tokens skipped


def test_max_tokens_and_max_model_len_give_length(llm):
    prompts = random_prompts([10, MAX_MODEL_LEN - 3], seed=21)
    outputs = llm.generate(prompts, [greedy(5), SamplingParams(temperature=0.0, max_tokens=None,
                                                               ignore_eos=True)],
                           use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 3]
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]

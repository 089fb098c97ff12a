"""Completions through the OpenAI API of the package's server (conftest.py): the served model
name, whole and streamed, usage, n, logprobs (and their text offsets), prompts as text, token
ids or lists of either, and echo."""

from __future__ import annotations

import json
import os

import openai
import pytest

from ..servers import LONG_MAX_MODEL_LEN
from .conftest import MODEL, Collected, assert_usage, complete


def test_models_lists_the_served_name(server, client, tiny_llama_long):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = server.get_json("/v1/models")
    assert status == 200 and body["object"] == "list"
    assert body["data"][0]["id"] == MODEL and body["data"][0]["object"] == "model"
    assert body["data"][0]["max_model_len"] == LONG_MAX_MODEL_LEN
    # Responses name the served model; the folder's own name is not served.
    assert complete(client, "hi", 2).model == MODEL
    folder_name = os.path.basename(tiny_llama_long.rstrip("/"))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=folder_name, prompt="hi", max_tokens=2)
    # "model" may be left out.
    status, raw = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and json.loads(raw)["model"] == MODEL


# --- completions -----------------------------------------------------------------------------
def test_completion_json(client, tiny_tokenizer):
    r = complete(client, "hello", 12)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert isinstance(choice.text, str)
    assert_usage(r.usage, len(tiny_tokenizer.encode("hello")), 12)


def test_completion_stream_matches_json(client, tiny_tokenizer):
    whole = complete(client, "Once upon a time", 20)
    stream = complete(client, "Once upon a time", 20, stream=True,
                      stream_options={"include_usage": True})
    got = Collected(stream, chat=False)
    assert got.text == {0: whole.choices[0].text}
    assert got.finish == {0: ["length"]}
    assert all(c.object == "text_completion" and c.model == MODEL for c in got.chunks)
    assert len({c.id for c in got.chunks}) == 1
    assert_usage(got.usage, len(tiny_tokenizer.encode("Once upon a time")), 20)


def test_stream_without_include_usage_has_no_usage(client):
    got = Collected(complete(client, "hello", 5, stream=True), chat=False)
    assert got.usage is None and got.finish == {0: ["length"]}
    assert all(c.usage is None for c in got.chunks)


def test_completion_n2(client):
    r = complete(client, "abc", 10, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text  # greedy: both samples agree
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == 3

    sampled = complete(client, "abc", 10, n=2, temperature=1.0, seed=7)
    assert [c.index for c in sampled.choices] == [0, 1]
    assert sampled.usage.completion_tokens == 20
    got = Collected(complete(client, "abc", 10, n=2, temperature=1.0, seed=7, stream=True,
                             stream_options={"include_usage": True}), chat=False)
    assert got.finish == {0: ["length"], 1: ["length"]}
    # Seeded sampling is reproducible: streamed or not, each index gets the same text.
    assert got.text == {c.index: c.text for c in sampled.choices}
    assert_usage(got.usage, 3, 20)


def test_completion_logprobs(client):
    n_top = 3
    r = complete(client, "The quick brown fox", 8, logprobs=n_top)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert len(lp.text_offset) == 8 and lp.text_offset[0] == 0
    for i in range(1, 8):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert isinstance(token, str)
        assert logprob <= 0.0
        # A dict keyed by token text: tokens that decode alike share a key, so <= n entries.
        assert isinstance(top, dict) and 1 <= len(top) <= n_top
        assert all(v <= 0.0 for v in top.values())
        # Greedy picks the argmax: nothing in the top list is more likely.
        assert logprob >= max(top.values()) - 1e-5
    # logprobs=0: the sampled token's logprob only.
    r0 = complete(client, "The quick brown fox", 8, logprobs=0)
    assert r0.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert all(top == {} for top in r0.choices[0].logprobs.top_logprobs)
    # Streamed: the same logprobs, one per token.
    got = Collected(complete(client, "The quick brown fox", 8, logprobs=n_top, stream=True),
                    chat=False)
    assert got.logprobs[0] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_completion_logprobs_streamed_text_offset(client):
    whole = complete(client, "The quick brown fox", 12, logprobs=1).choices[0].logprobs
    assert any(whole.text_offset), "pick a prompt whose tokens have text"
    got = complete(client, "The quick brown fox", 12, logprobs=1, stream=True)
    offsets = [o for chunk in got for c in chunk.choices for o in c.logprobs.text_offset]
    assert offsets == whole.text_offset


def test_completion_prompt_as_token_ids(client, tiny_tokenizer):
    ids = tiny_tokenizer.encode("hello")
    by_text = complete(client, "hello", 12)
    by_ids = complete(client, ids, 12)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert_usage(by_ids.usage, len(ids), 12)
    other = [7, 8, 9, 10, 11, 300]
    r = complete(client, other, 6)
    assert_usage(r.usage, len(other), 6)


def test_completion_prompt_as_list(client, tiny_tokenizer):
    texts = ["hello", "1 2 3 4"]
    singles = [complete(client, t, 9).choices[0].text for t in texts]
    r = complete(client, texts, 9)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == singles
    assert_usage(r.usage, sum(len(tiny_tokenizer.encode(t)) for t in texts), 18)
    # A list of token-id lists works the same.
    r_ids = complete(client, [tiny_tokenizer.encode(t) for t in texts], 9)
    assert [c.text for c in r_ids.choices] == singles
    # Streamed, each choice index carries its own prompt's text.
    got = Collected(complete(client, texts, 9, stream=True), chat=False)
    assert got.text == {0: singles[0], 1: singles[1]}
    assert got.finish == {0: ["length"], 1: ["length"]}


def test_completion_echo(client, tiny_tokenizer):
    plain = complete(client, "hello", 8).choices[0].text
    r = complete(client, "hello", 8, echo=True)
    assert r.choices[0].text == "hello" + plain
    assert r.usage.completion_tokens == 8
    ids = tiny_tokenizer.encode("hello")
    assert complete(client, ids, 8, echo=True).choices[0].text == "hello" + plain
    got = Collected(complete(client, "hello", 8, echo=True, stream=True), chat=False)
    assert got.chunks[0].choices[0].text.startswith("hello")
    assert got.text == {0: "hello" + plain}

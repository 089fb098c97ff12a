"""Bad requests against the package's server (conftest.py): malformed JSON, wrong types,
numbers out of range, prompts past the context, unknown models, fields and routes, each get the
right status and OpenAI's error body naming the field; the fields OpenAI knows are accepted."""

from __future__ import annotations

import json

import pytest

from ..servers import TINY_MAX_MODEL_LEN
from .conftest import AUTH, CHAT, COMPLETIONS, MSG, assert_healthy, assert_openai_error

LONG_PROMPT = "x" * (TINY_MAX_MODEL_LEN - 6)  # one byte-level token per character

BAD_REQUESTS = [
    # (id, path, body, status, param, words in the message)
    ("malformed-json", COMPLETIONS, b'{"prompt": "hi", "max_tokens": ', 400, None, ("JSON",)),
    ("not-an-object", COMPLETIONS, b"[1, 2, 3]", 400, None, ()),
    ("empty-body", CHAT, b"", 400, None, ()),
    ("max-tokens-string", COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, 400, None,
     ("max_tokens",)),
    ("prompt-number", COMPLETIONS, {"prompt": 5}, 400, None, ("prompt",)),
    ("prompt-missing", COMPLETIONS, {"max_tokens": 3}, 400, None, ("prompt",)),
    ("temperature-string", CHAT, {"messages": MSG, "temperature": "hot"}, 400, None,
     ("temperature",)),
    ("messages-string", CHAT, {"messages": "hi"}, 400, None, ("messages",)),
    ("stream-not-bool", COMPLETIONS, {"prompt": "hi", "stream": "yes"}, 400, None,
     ("stream",)),
    ("unknown-model", COMPLETIONS, {"model": "gpt-4o", "prompt": "hi"}, 404, "model",
     ("gpt-4o",)),
    ("unknown-model-chat", CHAT, {"model": "gpt-4o", "messages": MSG}, 404, "model",
     ("gpt-4o",)),
    ("too-long", COMPLETIONS, {"prompt": LONG_PROMPT, "max_tokens": 10}, 400, "max_tokens",
     (str(TINY_MAX_MODEL_LEN), str(len(LONG_PROMPT) + 10))),
    ("too-long-default-max-tokens", COMPLETIONS, {"prompt": LONG_PROMPT}, 400, "max_tokens",
     (str(TINY_MAX_MODEL_LEN), str(len(LONG_PROMPT) + 16))),
    ("too-long-chat", CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}],
                             "max_tokens": 10}, 400, "max_tokens",
     (str(TINY_MAX_MODEL_LEN),)),
    ("temperature-negative", COMPLETIONS, {"prompt": "hi", "temperature": -1}, 400,
     "temperature", ()),
    ("top-p-zero", COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p", ()),
    ("n-zero", COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n", ()),
    ("temperature-negative-chat", CHAT, {"messages": MSG, "temperature": -1}, 400,
     "temperature", ()),
    ("top-p-zero-chat", CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p", ()),
    ("n-zero-chat", CHAT, {"messages": MSG, "n": 0}, 400, "n", ()),
    ("max-tokens-zero", COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ()),
    ("invalid-while-streaming", COMPLETIONS, {"prompt": "hi", "temperature": -1,
                                              "stream": True}, 400, "temperature", ()),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages", ()),
    ("bad-role", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages",
     ("tool",)),
    ("image-content", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url"}]}]}, 400, "messages", ("image_url",)),
    ("suffix", COMPLETIONS, {"prompt": "hi", "suffix": "bye"}, 400, "suffix", ()),
    ("empty-prompt", COMPLETIONS, {"prompt": []}, 400, "prompt", ()),
    ("empty-token-list", COMPLETIONS, {"prompt": [[1, 2], []]}, 400, "prompt", ()),
    ("token-outside-vocab", COMPLETIONS, {"prompt": [1, 100000]}, 400, "prompt", ("100000",)),
    ("mixed-prompt", COMPLETIONS, {"prompt": ["a", 1]}, 400, "prompt", ()),
    ("logprobs-21", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", ()),
    ("top-logprobs-21", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", ()),
    ("empty-stop", COMPLETIONS, {"prompt": "hi", "stop": ""}, 400, "stop", ()),
    ("echo-with-logprobs", COMPLETIONS, {"prompt": "hi", "echo": True, "logprobs": 1}, 400,
     "echo", ()),
    ("best-of", COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "best_of", ()),
    ("logit-bias", COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 1.0}}, 400,
     "logit_bias", ()),
    # Admission limits (issue 17): every out-of-range number is a 400 naming its field.
    ("n-100000", COMPLETIONS, {"prompt": "hi", "n": 100000}, 400, "n", ("128",)),
    ("n-100000-chat", CHAT, {"messages": MSG, "n": 100000}, 400, "n", ("128",)),
    ("best-of-100000", COMPLETIONS, {"prompt": "hi", "best_of": 100000}, 400, "best_of", ()),
    ("choices-over-256", COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 100}, 400, "n",
     ("256",)),
    ("seed-2-80", COMPLETIONS, {"prompt": "hi", "seed": 2**80}, 400, "seed", ()),
    ("seed-2-80-chat", CHAT, {"messages": MSG, "seed": -(2**80)}, 400, "seed", ()),
    ("top-k-2-40", COMPLETIONS, {"prompt": "hi", "top_k": 2**40}, 400, "top_k", ()),
    ("max-tokens-2-40", COMPLETIONS, {"prompt": "hi", "max_tokens": 2**40}, 400, "max_tokens",
     ()),
    ("token-id-2-70", COMPLETIONS, {"prompt": [1, 2**70]}, 400, "prompt", ()),
    ("stop-token-negative", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [-1]}, 400,
     "stop_token_ids", ()),
    ("temperature-infinite", COMPLETIONS, b'{"prompt": "hi", "temperature": 1e999}', 400,
     "temperature", ()),
    ("stop-65", COMPLETIONS, {"prompt": "hi", "stop": ["x"] * 65}, 400, "stop", ()),
    # Strict fields: unknown to OpenAI and to parashift, named; known but unsupported, named.
    ("unknown-field", COMPLETIONS, {"prompt": "hi", "max_token": 3}, 400, "max_token",
     ("max_token",)),
    ("unknown-field-chat", CHAT, {"messages": MSG, "temprature": 0}, 400, "temprature", ()),
    ("unknown-message-field", CHAT, {"messages": [{"role": "user", "content": "x",
                                                   "mood": "happy"}]}, 400, "mood", ()),
    ("tools", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools", ()),
    ("response-format", CHAT, {"messages": MSG, "response_format": {"type": "yaml"}},
     400, "response_format", ()),
    ("tool-choice-without-tools", CHAT, {"messages": MSG, "tool_choice": "required"}, 400,
     "tool_choice", ("needs tools",)),
]


@pytest.mark.parametrize("path,body,status,param,contains",
                         [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request(server, path, body, status, param, contains):
    got_status, raw = server.request("POST", path, body, headers=AUTH)
    assert_openai_error(got_status, raw, status, param, contains)
    assert_healthy(server)


def test_too_long_message_names_both_numbers(server):
    status, raw = server.request("POST", COMPLETIONS, {"prompt": "y" * 200, "max_tokens": 100},
                                 headers=AUTH)
    error = assert_openai_error(status, raw, 400, "max_tokens")
    assert "256" in error["message"] and "300" in error["message"]  # the limit and the ask
    assert "200" in error["message"] and "100" in error["message"]  # its two parts
    assert_healthy(server)


def test_overlong_chat_prompt_without_max_tokens_names_the_context_length(server):
    long_chat = {"messages": [{"role": "user", "content": "z" * 300}]}
    status, raw = server.request("POST", CHAT, long_chat, headers=AUTH)
    error = assert_openai_error(status, raw, 400)
    assert str(TINY_MAX_MODEL_LEN) in error["message"], error["message"]
    assert_healthy(server)


def test_wrong_method_and_unknown_route(server):
    status, raw = server.request("GET", COMPLETIONS, headers=AUTH)
    assert_openai_error(status, raw, 405)
    status, raw = server.request("POST", "/v1/embeddings", {"input": "x"}, headers=AUTH)
    assert_openai_error(status, raw, 404)
    assert_healthy(server)


def test_bad_data_parallel_rank_header(server):
    status, raw = server.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2},
                                 headers={**AUTH, "X-data-parallel-rank": "7"})
    assert_openai_error(status, raw, 400)
    assert_healthy(server)


def test_fields_openai_knows_are_accepted(server):
    body = {"messages": [{"role": "developer", "content": "be brief"}] + MSG, "max_tokens": 2,
            "store": False, "metadata": {"k": "v"}, "tool_choice": "none",
            "response_format": {"type": "text"}, "parallel_tool_calls": False,
            "stream_options": None, "user": "u"}
    status, raw = server.request("POST", CHAT, body, headers=AUTH)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] <= 2

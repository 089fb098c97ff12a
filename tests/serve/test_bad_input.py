"""Bad requests against a real `parashift run` started with --api-key: each gets the right
status and OpenAI's error body, and the server stays healthy after every one."""

from __future__ import annotations

import json

import openai
import pytest

from .conftest import TINY_ARGS, TINY_MAX_MODEL_LEN, running_server

API_KEY = "sk-parashift-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hi"}]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, *TINY_ARGS, "--api-key", API_KEY) as s:
        yield s


def assert_openai_error(status: int, raw: bytes, expected_status: int,
                        param: str | None = None, contains: tuple[str, ...] = ()) -> dict:
    assert status == expected_status, raw
    body = json.loads(raw)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    if param is not None:
        assert error["param"] == param, error
    for text in contains:
        assert text in error["message"], error
    return error


def assert_healthy(server) -> None:
    status, body = server.get_json("/health")
    assert status == 200 and body["status"] == "ok", body


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


# --- API key ---------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": API_KEY}],
                         ids=["missing", "wrong", "no-bearer"])
def test_api_key_is_required(server, headers):
    for method, path, body in [("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2}),
                               ("POST", CHAT, {"messages": MSG, "max_tokens": 2}),
                               ("GET", "/v1/models", None)]:
        status, raw = server.request(method, path, body, headers=headers)
        error = assert_openai_error(status, raw, 401)
        assert error["code"] == "invalid_api_key"
    assert_healthy(server)


def test_openai_client_with_wrong_key(server):
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(api_key="wrong").completions.create(model=server.model_name, prompt="hi",
                                                          max_tokens=2)
    assert info.value.status_code == 401
    assert_healthy(server)


def test_openai_client_errors_are_typed(server):
    client = server.client(api_key=API_KEY)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model_name, messages=MSG, temperature=-1)
    assert info.value.status_code == 400 and info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=MSG, max_tokens=2)
    assert info.value.code == "model_not_found"
    assert_healthy(server)


def test_right_key_works_and_health_needs_none(server):
    client = server.client(api_key=API_KEY)
    r = client.chat.completions.create(model=server.model_name, messages=MSG, max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert [m.id for m in client.models.list().data] == [server.model_name]
    assert server.request("GET", "/health")[0] == 200  # no key needed
    status, raw = server.request("GET", "/metrics")
    assert status == 200 and b"parashift_requests_total" in raw
    assert server.proc.poll() is None  # the launcher never went down

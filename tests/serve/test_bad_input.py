"""Bad requests against a real `parashift run` started with --api-key: each gets the right
status and OpenAI's error body, and the server stays healthy after every one."""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

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


def test_fields_openai_knows_are_accepted(server):
    body = {"messages": [{"role": "developer", "content": "be brief"}] + MSG, "max_tokens": 2,
            "store": False, "metadata": {"k": "v"}, "tool_choice": "none",
            "response_format": {"type": "text"}, "parallel_tool_calls": False,
            "stream_options": None, "user": "u"}
    status, raw = server.request("POST", CHAT, body, headers=AUTH)
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] <= 2


# --- OpenAPI ---------------------------------------------------------------------------------
def _validator(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


GOOD_BODIES = [
    (COMPLETIONS, "CompletionRequest", {"prompt": "hi", "max_tokens": 2}),
    (COMPLETIONS, "CompletionRequest", {"prompt": [[1, 2], [3]], "max_tokens": 1, "n": 2,
                                        "logprobs": 1, "stop": ["x"], "seed": 5}),
    (CHAT, "ChatCompletionRequest", {"messages": MSG, "max_tokens": 2, "stream": True,
                                     "stream_options": {"include_usage": True}}),
]


def test_openapi_describes_every_endpoint_and_the_bodies_it_accepts(server):
    status, raw = server.request("GET", "/openapi.json", headers=AUTH)
    doc = json.loads(raw)
    assert status == 200 and doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                 "/health", "/metrics", "/reset_prefix_cache", "/openapi.json",
                                 "/sleep", "/wake_up", "/is_sleeping"}
    jsonschema.Draft202012Validator.check_schema(
        {"components": doc["components"], "$ref": "#/components/schemas/CompletionRequest"})
    for path, name, body in GOOD_BODIES:
        _validator(doc, name).validate(body)
        status, raw = server.request("POST", path, body, headers=AUTH)
        assert status == 200, raw
    # What the schema refuses, the server refuses: the bad bodies above that are JSON objects.
    for case_id, path, body, expected, _, _ in BAD_REQUESTS:
        if not isinstance(body, dict) or expected == 404:
            continue
        name = "ChatCompletionRequest" if path == CHAT else "CompletionRequest"
        if not _validator(doc, name).is_valid(body):
            status, raw = server.request("POST", path, body, headers=AUTH)
            assert status == 400, (case_id, raw)


# --- fuzzing ---------------------------------------------------------------------------------
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                     st.floats(allow_nan=False), st.text(max_size=12))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)
_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of",
           "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
           "logprobs", "top_logprobs", "echo", "stream", "stream_options", "ignore_eos",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
           "tools", "response_format", "suffix", "user", "x_unknown"]
_GOOD = {"prompt": st.sampled_from(["hi", ["a", "b"], [1, 2, 3]]),
         "messages": st.just(MSG), "max_tokens": st.integers(-2, 40),
         "n": st.integers(-1, 3), "temperature": st.floats(-1, 3),
         "logprobs": st.one_of(st.integers(-1, 22), st.booleans()),
         "stream": st.booleans(), "stop": st.sampled_from(["\n", ["a", ""], None]),
         "top_p": st.floats(0, 1), "top_k": st.integers(-2, 50), "seed": st.integers(-5, 99),
         "ignore_eos": st.booleans(), "echo": st.booleans(), "user": st.text(max_size=5),
         "stop_token_ids": st.lists(st.integers(-1, 300), max_size=3),
         "stream_options": st.just({"include_usage": True})}
# A valid body with up to three fields replaced: by plausible values mostly, by anything else
# (wrong types, huge numbers, nested junk, unknown names) often.
_OVERRIDES = st.dictionaries(st.sampled_from(_FIELDS), st.none(), max_size=3).flatmap(
    lambda names: st.fixed_dictionaries({name: st.one_of(_GOOD.get(name, _VALUES),
                                                           _GOOD.get(name, _VALUES), _VALUES)
                                         for name in names}))
_BASE = {COMPLETIONS: {"prompt": "hi", "max_tokens": 4}, CHAT: {"messages": MSG,
                                                                "max_tokens": 4}}
# A bounded budget for CI; the benchmark's larger run: PARASHIFT_FUZZ_EXAMPLES=5000 pytest -k fuzz
FUZZ_EXAMPLES = int(os.environ.get("PARASHIFT_FUZZ_EXAMPLES", "400"))


@settings(max_examples=FUZZ_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=st.sampled_from([COMPLETIONS, CHAT]), overrides=_OVERRIDES)
def test_fuzzed_bodies_get_a_completion_or_an_openai_error(server, path, overrides):
    body = {**_BASE[path], **overrides}
    status, raw = server.request("POST", path, body, headers=AUTH)
    event(f"HTTP {status}")  # --hypothesis-show-statistics shows the mix
    assert status < 500, (body, raw)
    if status != 200:
        assert_openai_error(status, raw, status)
    elif body.get("stream") is True:
        events = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", raw
        for line in events[:-1]:
            assert "error" not in json.loads(line[6:]), (body, line)
    else:
        reply = json.loads(raw)
        assert reply["choices"] and reply["usage"]["completion_tokens"] >= 1, reply


def test_the_server_is_whole_after_the_fuzzing(server):
    status, raw = server.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2},
                                 headers=AUTH)
    assert status == 200, raw
    assert_healthy(server)
    assert server.metric("parashift_kv_cache_usage_ratio", 'engine="dp0"') == 0.0  # no leak
    assert server.proc.poll() is None


# --- cross-site requests, admin routes, bounded work -------------------------------------------
def test_json_routes_take_only_application_json(server):
    for path, body in ((COMPLETIONS, {"prompt": "hi", "max_tokens": 2}),
                       (CHAT, {"messages": MSG, "max_tokens": 2})):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "", "text/json"):
            status, raw = server.request("POST", path, body,
                                         headers={**AUTH, "Content-Type": content_type})
            error = assert_openai_error(status, raw, 415, contains=("application/json",))
            assert error["code"] == "unsupported_media_type"
    assert_healthy(server)


def test_every_route_but_health_and_metrics_needs_the_key(server):
    routes = [("GET", "/openapi.json"), ("POST", "/reset_prefix_cache"),
              ("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]
    for method, path in routes:
        status, raw = server.request(method, path, headers={"Content-Type": ""})
        assert_openai_error(status, raw, 401)
    for method, path in routes:
        status, raw = server.request(method, path, headers={**AUTH, "Content-Type": ""})
        assert 200 <= status < 300, (path, raw)
    assert_healthy(server)


def test_a_cross_origin_browser_request_is_refused(server):
    for path, body in ((COMPLETIONS, {"prompt": "hi", "max_tokens": 2}),
                       ("/reset_prefix_cache", None)):
        status, raw = server.request("POST", path, body,
                                     headers={**AUTH, "Origin": "http://evil.example"})
        assert_openai_error(status, raw, 403, contains=("cross-origin",))
    # An admin route takes no form or text body (what a page may post without asking first).
    status, raw = server.request("POST", "/sleep?level=1", b"x=1",
                                 headers={**AUTH, "Content-Type": "text/plain"})
    assert_openai_error(status, raw, 415)
    same_origin = {**AUTH, "Origin": server.url}
    status, raw = server.request("POST", COMPLETIONS, {"prompt": "hi", "max_tokens": 2},
                                 headers=same_origin)
    assert status == 200, raw


def test_a_body_past_the_limit_is_a_413(server):
    body = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    status, raw = server.request("POST", COMPLETIONS, body, headers=AUTH)
    assert_openai_error(status, raw, 413)
    assert_healthy(server)


def test_huge_requests_are_refused_while_health_stays_responsive(server):
    """A million prompts and a 4 MB chat message are refused before any tokenizing, and the
    event loop keeps answering /health meanwhile (each poll's latency, from the client)."""
    import concurrent.futures
    import time

    many = json.dumps({"prompt": ["a"] * 1_000_000, "max_tokens": 1}).encode()
    big_chat = {"messages": [{"role": "user", "content": "word " * 800_000}], "max_tokens": 1}
    done, latencies = [], []

    def poll() -> None:
        while not done:
            start = time.perf_counter()
            status, _ = server.request("GET", "/health", timeout=10)
            latencies.append(time.perf_counter() - start)
            assert status == 200
            time.sleep(0.1)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        poller = pool.submit(poll)
        first = pool.submit(server.request, "POST", COMPLETIONS, many, AUTH, 60)
        second = pool.submit(server.request, "POST", CHAT, big_chat, AUTH, 60)
        (s1, raw1), (s2, raw2) = first.result(), second.result()
        done.append(True)
        poller.result()
    assert_openai_error(s1, raw1, 400, param="n", contains=("1000000 prompts",))
    assert_openai_error(s2, raw2, 400, param="messages", contains=("characters",))
    assert latencies and max(latencies) < 1.0, latencies


def test_stop_strings_past_their_limits_are_refused(server):
    for stop, words in ((["x" * 200_000], ("1024",)), (["a"] * 65, ("64",))):
        status, raw = server.request("POST", COMPLETIONS,
                                     {"prompt": "hi", "max_tokens": 2, "stop": stop},
                                     headers=AUTH)
        assert_openai_error(status, raw, 400, param="stop", contains=words)


def test_the_key_from_the_environment_stays_out_of_ps_and_logs(tiny_llama):
    import psutil

    secret = "sk-from-the-environment-7f3a"
    with running_server(tiny_llama, *TINY_ARGS,
                        env={"PARASHIFT_API_KEY": secret}) as s:
        assert s.request("GET", "/v1/models")[0] == 401
        status, _ = s.request("GET", "/v1/models",
                              headers={"Authorization": f"Bearer {secret}"})
        assert status == 200
        tree = [psutil.Process(s.proc.pid), *psutil.Process(s.proc.pid).children(recursive=True)]
        for proc in tree:
            assert secret not in " ".join(proc.cmdline()), proc.name()
    assert secret not in s.output()

"""Fuzzed request bodies against the package's server (conftest.py): a valid body with up to
three fields replaced gets a completion or an OpenAI error, never a 5xx, and the server is
whole afterwards."""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from .conftest import AUTH, CHAT, COMPLETIONS, MSG, assert_healthy, assert_openai_error

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

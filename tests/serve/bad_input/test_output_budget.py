"""The per-request output budget (serve/output_budget.py) against the package's server, whose
context of 256 tokens makes the default budget 256 x (1 + 20) = 5,376 units: a request beyond
it is a 400 naming the product and its fields (n, max_tokens, logprobs or top_logprobs,
echo, max_tokens unset); one exactly at it completes while /health keeps answering within
1 s (its body is built off the event loop). test_tool_calls.py checks the flag."""

from __future__ import annotations

import json

from parashift.serve.output_budget import default_output_units

from ..health_poller import HealthPoller
from ..servers import TINY_MAX_MODEL_LEN
from .conftest import AUTH, CHAT, COMPLETIONS, MSG, assert_healthy, assert_openai_error

BUDGET = default_output_units(TINY_MAX_MODEL_LEN)
IGNORE_EOS = {"ignore_eos": True, "temperature": 0.0}


def test_the_default_fits_one_full_context_with_every_logprob():
    assert BUDGET == TINY_MAX_MODEL_LEN * 21 == 5376
    # the 9 MB body: n=32 x 512 tokens x (1 + 20) does not fit an 8k context
    assert 32 * 512 * 21 > default_output_units(8192) >= 8192 * 21


def test_a_completion_over_the_budget_names_the_product(server):
    status, raw = server.request("POST", COMPLETIONS, {
        "prompt": "hi", "n": 16, "max_tokens": 17, "logprobs": 20}, headers=AUTH)
    assert_openai_error(status, raw, 400, param="n", contains=(
        "n=16", "max_tokens=17", "logprobs=20", "5,712", "5,376",
        "--max-request-output-units"))
    assert_healthy(server)


def test_a_chat_over_the_budget_names_top_logprobs(server):
    status, raw = server.request("POST", CHAT, {
        "messages": MSG, "n": 16, "max_tokens": 17, "logprobs": True, "top_logprobs": 20},
        headers=AUTH)
    assert_openai_error(status, raw, 400, param="n", contains=(
        "n=16", "max_tokens=17", "top_logprobs=20", "5,712"))


def test_max_tokens_unset_counts_the_room_the_context_leaves(server):
    # a short chat leaves ~230 tokens of room: 24 samples of it are past 5,376
    status, raw = server.request("POST", CHAT, {"messages": MSG, "n": 24}, headers=AUTH)
    assert_openai_error(status, raw, 400, param="n", contains=("max_tokens unset", "n=24"))
    status, raw = server.request("POST", CHAT, {"messages": MSG, "n": 24, "max_tokens": 8},
                                 headers=AUTH)
    assert status == 200, raw


def test_the_echoed_prompt_counts(server):
    body = {"prompt": "x" * 100, "n": 48, "max_tokens": 16}
    assert server.request("POST", COMPLETIONS, body, headers=AUTH)[0] == 200
    status, raw = server.request("POST", COMPLETIONS, {**body, "echo": True}, headers=AUTH)
    assert_openai_error(status, raw, 400, param="n", contains=("echo", "n=48"))


def test_a_request_at_the_budget_completes_while_health_answers(server):
    """16 x 16 tokens x (1 + 20) = 5,376 units, as a completion and as a chat: each body is
    whole (every token's 20 alternatives), and every /health answer took under 1 s."""
    with HealthPoller(server) as poller:
        status, raw = server.request("POST", COMPLETIONS, {
            "prompt": "hi", "n": 16, "max_tokens": 16, "logprobs": 20, **IGNORE_EOS},
            headers=AUTH, timeout=120)
        assert status == 200, raw
        choices = json.loads(raw)["choices"]
        assert len(choices) == 16
        for choice in choices:
            assert len(choice["logprobs"]["top_logprobs"]) == 16
            assert all(len(top) >= 1 for top in choice["logprobs"]["top_logprobs"])
        status, raw = server.request("POST", CHAT, {
            "messages": MSG, "n": 16, "max_tokens": 16, "logprobs": True, "top_logprobs": 20,
            **IGNORE_EOS}, headers=AUTH, timeout=120)
        assert status == 200, raw
        for choice in json.loads(raw)["choices"]:
            content = choice["logprobs"]["content"]
            assert len(content) == 16 and all(len(e["top_logprobs"]) == 20 for e in content)
    poller.assert_responsive(1.0)

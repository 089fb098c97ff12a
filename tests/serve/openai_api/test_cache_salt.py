"""cache_salt (vLLM's field) on a real server: requests with different salts share no prefix
block, so the first request of each salt reports cached_tokens 0 whatever the others sent, and
a repeat within one salt hits; the field is bounded."""

from __future__ import annotations

import json

import pytest

from .conftest import MESSAGES, MODEL

# Token ids (the completions API takes them): 70 tokens, 4 full blocks of 16, used by no
# other test of the package.
PROMPT = [(29 * j) % 311 + 3 for j in range(70)]


def cached_tokens(server, path: str, body: dict) -> int:
    status, raw = server.request("POST", path, {"model": MODEL, "max_tokens": 2,
                                                "temperature": 0, **body})
    assert status == 200, raw
    return json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_salts_keep_prefix_hits_apart_on_completions(server):
    def ask(**salt: str) -> int:
        return cached_tokens(server, "/v1/completions", {"prompt": PROMPT, **salt})

    assert ask(cache_salt="tenant-a") == 0
    assert ask(cache_salt="tenant-b") == 0  # the same prompt, another tenant: no hit
    assert ask() == 0  # nor for a request without a salt
    assert ask(cache_salt="tenant-a") == 64  # its own blocks
    assert ask(cache_salt="tenant-b") == 64
    assert ask() == 64


def test_salts_keep_prefix_hits_apart_on_chat(server):
    messages = [*MESSAGES, {"role": "user", "content": "cache salt " * 40}]

    def ask(salt: str) -> int:
        return cached_tokens(server, "/v1/chat/completions",
                             {"messages": messages, "cache_salt": salt})

    assert ask("tenant-a") == 0
    assert ask("tenant-b") == 0
    assert ask("tenant-a") > 0


@pytest.mark.parametrize("salt", ["", "s" * 1025, 7])
def test_a_salt_is_a_bounded_string(server, salt):
    status, raw = server.request("POST", "/v1/completions", {
        "model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": salt})
    assert status == 400 and b"cache_salt" in raw, raw

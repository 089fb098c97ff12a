"""`parashift run --deterministic` with the real SmolLM2 in bfloat16: the same chat request
gives the same text and logprobs five times in a row (cold, then from the prefix cache, then
beside other requests), on either rank of dp2, and on a second server started with async
scheduling on (one rank, two threads): the same bits from one start to the next. Offline,
batch by batch: tests/engine/test_deterministic.py."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from .servers import running_server

pytestmark = pytest.mark.slow

COMMON = ("--deterministic", "--dtype", "bfloat16", "--max-model-len", "512",
          "--kv-cache-memory", "64MiB")
CHAT = {"messages": [{"role": "user", "content": "Name two colours of the rainbow."}],
        "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 5}
SEEDED = {"prompt": "The three primary colours are", "max_tokens": 16, "temperature": 1.0,
          "top_p": 0.9, "seed": 5, "n": 3, "logprobs": 5}
OTHERS = [{"prompt": f"Count from {i} to {i + 9}:", "max_tokens": 20 + i, "temperature": 0.7}
          for i in range(4)]


@pytest.fixture(scope="module")
def server(smollm2_path):
    with running_server(smollm2_path, *COMMON, "--strategy", "dp2",
                        "--no-async-scheduling") as s:
        yield s


def post(server, path: str, body: dict, rank: int | None = None) -> dict:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    status, raw = server.request("POST", path, body, headers=headers, timeout=120)
    assert status == 200, raw
    return json.loads(raw)


def bits(answer: dict) -> list:
    """What must not change: each choice's text (or message) and logprobs."""
    return [(c.get("message", {}).get("content", c.get("text")), c["logprobs"])
            for c in answer["choices"]]


def test_the_same_chat_five_times_cold_cached_and_in_company(server):
    first = post(server, "/v1/chat/completions", CHAT, rank=0)
    assert bits(first)[0][0].strip()
    again = [post(server, "/v1/chat/completions", CHAT, rank=0) for _ in range(2)]
    assert again[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        for _ in range(2):  # beside four other requests on the same rank
            others = [pool.submit(post, server, "/v1/completions", o, 0) for o in OTHERS]
            again.append(post(server, "/v1/chat/completions", CHAT, rank=0))
            for o in others:
                o.result()
    assert all(bits(a) == bits(first) for a in again)


def test_both_ranks_give_the_same_bits(server):
    for body, path in ((CHAT, "/v1/chat/completions"), (SEEDED, "/v1/completions")):
        assert bits(post(server, path, body, rank=0)) == bits(post(server, path, body, rank=1))


def test_a_second_start_with_async_scheduling_gives_the_same_bits(server, smollm2_path):
    want = [bits(post(server, "/v1/chat/completions", CHAT)),
            bits(post(server, "/v1/completions", SEEDED))]
    with running_server(smollm2_path, *COMMON, "--strategy", "dp1",
                        "--async-scheduling") as second:
        assert [bits(post(second, "/v1/chat/completions", CHAT)),
                bits(post(second, "/v1/completions", SEEDED))] == want

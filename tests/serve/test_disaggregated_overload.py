"""p1xd1 (issue 57) under more streams than its queues hold (a decode rank of one seat, a
prefill rank of four, one waiting request each): each stream of a burst either completes, is
refused with a 429 before its first token, or, refused by every rank in its decode phase past
the hold for room, ends with a rate-limit error event naming that phase (which of these each
stream meets depends on timing; serve/test_overload.py drives each path in turn); none hangs,
both ranks end up holding nothing, and the server serves on."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from .servers import LONG_ARGS, holds_nothing, running_server

pytestmark = pytest.mark.slow

STREAMS = 12
MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def server(tiny_llama_long):
    with running_server(tiny_llama_long, *LONG_ARGS, "--strategy", "p1xd1",
                        "--prefill-max-num-seqs", "4", "--decode-max-num-seqs", "1",
                        "--max-waiting-requests", "1") as s:
        yield s


def outcome(server, k: int) -> str:
    """'done', '429' or 'refused mid-stream'; anything else fails the test."""
    body = {"prompt": f"stream {k} says", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    status, raw = server.request("POST", "/v1/completions", body, timeout=120)
    if status == 429:
        assert json.loads(raw)["error"]["type"] == "rate_limit_error", raw
        return "429"
    assert status == 200, raw
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: {")]
    if "error" in events[-1]:
        error = events[-1]["error"]
        assert error["type"] == "rate_limit_error" and "the decode phase" in error["message"]
        return "refused mid-stream"
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"], events[-3:]
    return "done"


def test_a_burst_beyond_every_queue_completes_or_is_refused_and_nothing_is_held(server):
    with ThreadPoolExecutor(STREAMS) as pool:
        outcomes = list(pool.map(lambda k: outcome(server, k), range(STREAMS)))
    assert "done" in outcomes, outcomes
    holds_nothing(server, 0, 1)
    assert outcome(server, STREAMS) == "done"

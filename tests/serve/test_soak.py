"""The soak in short form (`python scripts/soak.py` runs 5,000): 300 mixed requests on dp2 with
two API servers, bad ones, clients that leave, and engine dp1 SIGKILLed part-way; the same
promises as the long run (scripts/soak_run.py `SoakReport.failures`)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from conftest import TINY_VOCAB
from soak_requests import plan
from soak_run import SERVER_ARGS, run_soak
from study_server import running_server

NUM_REQUESTS = 300


@pytest.mark.slow
def test_short_soak_keeps_every_promise(tiny_llama_long):
    requests = plan(NUM_REQUESTS, TINY_VOCAB, seed=1)
    kinds = Counter(r.kind for r in requests)
    assert set(kinds) == {"good", "special", "bad", "disconnect"}, kinds
    with running_server(tiny_llama_long, SERVER_ARGS, env={"OMP_NUM_THREADS": "1"}) as server:
        report = asyncio.run(run_soak(server.url, server.proc.pid, requests, 16,
                                      kill_at=NUM_REQUESTS * 2 // 5))
    assert not report.failures(), report.failures()
    assert len(report.outcomes) == NUM_REQUESTS
    assert report.kill_at is not None and report.back_after_s is not None
    assert report.counts()["good"]["ok"] >= kinds["good"] * 0.8
    assert set(report.kv_usage_after) == {"dp0", "dp1"}

"""`parashift run --strategy dp2`: two engine processes behind one endpoint."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import time

import psutil
import pytest

from parashift import LLM, SamplingParams

from .conftest import running_server

ARGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
        "--strategy", "dp2")
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(5 + i % 7)] for i in range(32)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, *ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def expected(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def complete(server, prompt, rank=None):
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    status, raw = server.request("POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        headers=headers)
    assert status == 200, raw
    return json.loads(raw)


def process_names(server) -> set[str]:
    names = set()
    for proc in server.current_tree():
        with contextlib.suppress(psutil.Error):
            names.add(proc.name())
    return names


def routed(server, rank):
    return server.metric("parashift_engine_requests_total", f'engine="dp{rank}"') or 0.0


def test_both_ranks_up_with_their_own_process(server):
    assert server.get_json("/health")[0] == 200
    pids = {server.engine_process(r).pid for r in (0, 1)}
    assert len(pids) == 2
    for rank in (0, 1):
        assert server.metric("parashift_engine_up", f'engine="dp{rank}"') == 1.0
    names = process_names(server)
    assert "parashift-dp-coo" in {n[:16] for n in names}  # the DP coordinator (comm: 15 chars)
    # The coordinator's load vector (a heartbeat at least every second) gives this API server
    # a gauge for every rank, even before any request.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
            server.metric("parashift_num_requests_running", f'engine="dp{r}"') is None
            for r in (0, 1)):
        time.sleep(0.1)
    for rank in (0, 1):
        assert server.metric("parashift_num_requests_running", f'engine="dp{rank}"') == 0.0


def test_concurrent_requests_match_dp1_and_share_the_load(server, expected):
    before = [routed(server, r) for r in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        bodies = list(pool.map(lambda p: complete(server, p), PROMPTS))
    for body, want in zip(bodies, expected, strict=True):
        assert body["choices"][0]["text"] == want
    counts = [routed(server, r) - b for r, b in zip((0, 1), before, strict=True)]
    assert sum(counts) == len(PROMPTS)
    assert max(counts) <= 2 * min(counts), counts


def test_pinning_with_the_header(server, expected):
    for rank in (0, 1):
        before = routed(server, rank)
        for prompt, want in zip(PROMPTS[:4], expected[:4], strict=True):
            assert complete(server, prompt, rank)["choices"][0]["text"] == want
        assert routed(server, rank) - before == 4


def test_killed_rank_is_reported_and_the_other_serves(tiny_llama):
    with running_server(tiny_llama, *ARGS) as s:
        victim = s.engine_process(1)
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while s.get_json("/health")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        status, body = s.get_json("/health")
        assert status == 503 and "dp1" in body["detail"]
        for prompt in PROMPTS[:6]:  # unpinned requests all go to the live rank
            complete(s, prompt)
        status, raw = s.request("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2},
                                headers={"X-data-parallel-rank": "1"})
        assert status == 503 and b"dp1" in raw


def test_two_api_servers_share_the_port_and_route_outputs_back(tiny_llama, expected):
    with running_server(tiny_llama, *ARGS, "--api-server-count", "2") as s:
        names = process_names(s)
        assert {"parashift-api-0", "parashift-api-1"} <= names, names
        # Separate connections (urllib opens one per request) land on both servers.
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            bodies = list(pool.map(lambda p: complete(s, p), PROMPTS))
        for body, want in zip(bodies, expected, strict=True):
            assert body["choices"][0]["text"] == want
        ids = {b["id"].split("-")[1] for b in bodies}  # cmpl-<server index>-<uuid>
        assert ids == {"0", "1"}, ids

"""Coordinated sleep and wake on dp2 behind two API servers: /sleep reaches both engines;
level 2 releases the KV cache and the weights (the engines' RSS drops by about that much) and
/wake_up brings them back with the same greedy outputs; both API servers' /metrics show it (the
one not called hears it through the coordinator); requests while asleep get the documented
503, or wait for the wake with --while-asleep wait."""

import concurrent.futures
import json
import re
import time

import psutil
import pytest

from .servers import running_server

KV = 64 << 20
ARGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "64MiB",
        "--strategy", "dp2", "--enable-admin-routes")
PROMPTS = [[(5 * i + j) % 250 + 1 for j in range(9 + i)] for i in range(3)]


@pytest.fixture(scope="module")
def wide_llama(tiny_model_factory) -> str:
    """~50 MB of float32 weights: big enough to see in RSS."""
    return tiny_model_factory("llama", hidden_size=512, intermediate_size=1024,
                              num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=4)


def engine_rss(server) -> dict[str, int]:
    out = {}
    for proc in server.current_tree():
        try:
            name = proc.name()
            if name.startswith("parashift-engine-dp"):
                out[name.removeprefix("parashift-engine-")] = proc.memory_info().rss
        except psutil.Error:
            pass
    return out


def sleep_by_api_server(server, level: int, deadline_s: float = 15.0
                        ) -> dict[str, dict[str, float]]:
    """Each API server's sleep gauges (a scrape lands on either one): {index: {"level dp0":
    ..., "released dp0": ..., ...}}, once both servers show `level` for both ranks."""
    seen: dict[str, dict[str, float]] = {}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        status, raw = server.request("GET", "/metrics")
        text = raw.decode()
        index = re.search(r'^parashift_api_server\{index="(\d)"\} 1', text, re.MULTILINE)
        gauges = {f"{kind} {rank}": float(value) for kind, rank, value in re.findall(
            r'^parashift_engine_sleep_(level|released)(?:_bytes)?\{engine="(dp\d)"\} (\S+)$',
            text, re.MULTILINE)}
        if status == 200 and index:
            seen[index.group(1)] = gauges
        if len(seen) == 2 and all(g.get(f"level dp{r}") == level for g in seen.values()
                                  for r in (0, 1)):
            break
        time.sleep(0.05)
    return seen


def greedy(server) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        status, raw = server.request("POST", "/v1/completions", {
            "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert status == 200, raw
        texts.append(json.loads(raw)["choices"][0]["text"])
    return texts


def test_sleep_level_2_releases_kv_and_weights_and_wake_restores_them(wide_llama):
    with running_server(wide_llama, *ARGS, "--api-server-count", "2") as s:
        before_texts, before = greedy(s), engine_rss(s)
        status, body = s.request("POST", "/sleep?level=2", timeout=60)
        assert status == 200, body
        engines = json.loads(body)["engines"]
        assert set(engines) == {"dp0", "dp1"}
        assert all(e["level"] == 2 and e["released_bytes"] > KV for e in engines.values())
        assert s.get_json("/is_sleeping") == (200, {"is_sleeping": True,
                                                    "levels": {"dp0": 2, "dp1": 2}})
        asleep = engine_rss(s)
        for rank in ("dp0", "dp1"):  # the KV cache and ~50 MB of weights each
            assert before[rank] - asleep[rank] > KV + (30 << 20), (before, asleep)
        want = {"level dp0": 2, "level dp1": 2,
                "released dp0": engines["dp0"]["released_bytes"],
                "released dp1": engines["dp1"]["released_bytes"]}
        assert sleep_by_api_server(s, 2) == {"0": want, "1": want}
        status, raw = s.request("POST", "/v1/completions", {"prompt": [1, 2, 3],
                                                            "max_tokens": 2})
        error = json.loads(raw)["error"]
        assert status == 503 and "asleep" in error["message"], raw
        assert error["type"] == "service_unavailable_error"
        status, body = s.request("POST", "/sleep?level=3")
        assert status == 400 and json.loads(body)["error"]["param"] == "level"

        status, body = s.request("POST", "/wake_up", timeout=60)
        assert status == 200, body
        assert s.get_json("/is_sleeping")[1]["is_sleeping"] is False
        awake = engine_rss(s)
        for rank in ("dp0", "dp1"):
            assert awake[rank] - asleep[rank] > KV + (30 << 20), (asleep, awake)
        awake_gauges = {"level dp0": 0, "level dp1": 0, "released dp0": 0, "released dp1": 0}
        assert sleep_by_api_server(s, 0) == {"0": awake_gauges, "1": awake_gauges}
        assert greedy(s) == before_texts


@pytest.fixture(scope="module")
def holding_server(tiny_llama):
    """dp2 with --while-asleep wait and --max-num-seqs 1 (so at most 8 requests wait a rank)."""
    with running_server(tiny_llama, *ARGS, "--while-asleep", "wait", "--max-num-seqs", "1") as s:
        yield s


def num_waiting(server) -> float:
    """Requests waiting in either engine, those held while it sleeps included (an engine
    reports its backlog to the metrics)."""
    return sum(server.metric("parashift_num_requests_waiting", f'engine="dp{r}"') or 0
               for r in (0, 1))


def test_with_while_asleep_wait_a_request_waits_for_the_wake(holding_server):
    """Held, not refused: the sleeping engine counts the request in its backlog, and it runs
    at the wake with the outputs it would have had."""
    s = holding_server
    want = greedy(s)
    status, body = s.request("POST", "/sleep?level=1", timeout=60)
    assert status == 200 and json.loads(body)["engines"]["dp0"]["released_bytes"] > 0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(greedy, s)  # its first request reaches an engine and is held there
        deadline = time.monotonic() + 30
        while num_waiting(s) != 1:
            assert not held.done(), held.exception()  # refused: greedy's assert on the 200
            assert time.monotonic() < deadline, num_waiting(s)
            time.sleep(0.05)
        assert not held.done()
        assert s.request("POST", "/wake_up", timeout=60)[0] == 200
        assert held.result(timeout=60) == want


def test_requests_held_while_asleep_count_against_the_default_cap(holding_server):
    """--max-num-seqs 1: a served engine queues at most 8 x 1 requests by default, those held
    while it sleeps included; the next gets a 429 at once, and the held ones run at the wake."""
    s = holding_server
    assert s.request("POST", "/sleep?level=1", timeout=60)[0] == 200
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    dp0 = {"X-data-parallel-rank": "0"}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        held = [pool.submit(s.request, "POST", "/v1/completions", body, dp0, 120)
                for _ in range(8)]
        deadline = time.monotonic() + 30  # the engine reports its backlog to the metrics
        while s.metric("parashift_num_requests_waiting", 'engine="dp0"') != 8:
            assert time.monotonic() < deadline, s.metric("parashift_num_requests_waiting",
                                                        'engine="dp0"')
            time.sleep(0.1)
        status, raw = s.request("POST", "/v1/completions", body, dp0)
        assert status == 429 and b"holds 8 requests" in raw, raw
        assert s.request("POST", "/wake_up", timeout=60)[0] == 200
        assert [f.result(timeout=120)[0] for f in held] == [200] * 8

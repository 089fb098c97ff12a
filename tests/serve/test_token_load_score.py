"""The DP router's load score in tokens (`--dp-load-score tokens`, the default) against the
score in requests: the API server's score and, served on dp2, one long prompt and many short
ones going where the tokens say. (The engine's count of its work: test_scheduler.py.)"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import pytest

from parashift.serve.engine_client import EngineClient, request_tokens
from parashift.serve.engine_loads import EngineLoads
from parashift.serve.prefix_router import RoutingConfig
from parashift.types.outputs import SchedulerStats
from parashift.types.sampling_params import SamplingParams
from parashift.wire import protocol as p

from .servers import LONG_ARGS, running_server


def vector(*stats: SchedulerStats) -> p.LoadVector:
    return p.LoadVector(1, [p.EngineLoad(rank, s) for rank, s in enumerate(stats)])


# One waiting 4,000-token prompt on dp0; two waiting 100-token prompts on dp1; 16 outputs each.
LONG_ONE = SchedulerStats(1, 0, 0.0, prefill_tokens_left=4000, output_tokens_left=16)
SHORT_TWO = SchedulerStats(2, 0, 0.0, prefill_tokens_left=200, output_tokens_left=32)


def test_by_tokens_a_long_prompt_weighs_more_than_two_short_ones():
    loads = EngineLoads(by_tokens=True)
    loads.take(vector(LONG_ONE, SHORT_TWO))
    assert (loads.score(0), loads.score(1)) == (4016, 232)


def test_by_requests_the_long_prompt_looks_lighter():
    loads = EngineLoads(by_tokens=False)
    loads.take(vector(LONG_ONE, SHORT_TWO))
    assert (loads.score(0), loads.score(1)) == (4, 8)


def test_what_was_sent_counts_until_a_vector_says_the_engine_took_it():
    """Each engine's load counts the requests it has taken from each API server: a server
    adds on top only what it sent since, whenever the vectors were made."""
    loads = EngineLoads(by_tokens=True, client_index=1)
    idle = SchedulerStats(0, 0, 0.0)
    loads.take(vector(idle, idle))
    loads.sent(1, 300)
    loads.sent(1, 50)
    assert (loads.score(0), loads.score(1)) == (0, 350)
    # Made before dp1 took either (it has taken 4 of API server 0's, none of ours).
    loads.take(p.LoadVector(2, [p.EngineLoad(0, idle, received=[0, 0]),
                                p.EngineLoad(1, idle, received=[4, 0])]))
    assert loads.score(1) == 350
    loads.take(p.LoadVector(3, [p.EngineLoad(0, idle), p.EngineLoad(
        1, SchedulerStats(1, 0, 0.0, prefill_tokens_left=290, output_tokens_left=10),
        received=[4, 1])]))  # it took the first
    assert loads.score(1) == 300 + 50
    loads.new_incarnation(1)  # restarted: what went to the last one is gone
    assert loads.score(1) == 300
    loads.sent(1, 20)
    loads.take(p.LoadVector(4, [p.EngineLoad(0, idle), p.EngineLoad(1, idle,
                                                                       received=[0, 1])]))
    assert loads.score(1) == 0


def test_by_requests_what_was_sent_counts_one_each():
    loads = EngineLoads(by_tokens=False)
    loads.take(vector(SchedulerStats(0, 0, 0.0), SchedulerStats(0, 0, 0.0)))
    loads.sent(0, 9000)
    assert (loads.score(0), loads.score(1)) == (1, 0)


def test_without_a_vector_the_score_is_this_servers_tokens_in_flight(tmp_path):
    client = EngineClient(0, f"ipc://{tmp_path}/requests", f"ipc://{tmp_path}/outputs", 2)
    client._send_to = lambda rank, msg: None
    try:
        for rank in (0, 1):
            client.on_ready(p.EngineReady(rank, 256, 100, 0, 16))
        params = SamplingParams(max_tokens=10)
        client.add_request("long", [1] * 500, params, None, 0, lambda out: None)
        client.add_request("short", [1] * 5, params, None, 1, lambda out: None)
        assert (client.loads.score(0), client.loads.score(1)) == (510, 15)
        assert request_tokens([1] * 5, params) == 15
        assert client.pick_engine() == 1
        client.in_flight.forget("long")
        assert client.loads.score(0) == 0
    finally:
        client.ctx.destroy(linger=0)


def test_the_balance_threshold_defaults_to_the_scores_unit():
    assert RoutingConfig().balance_threshold == 1024
    assert RoutingConfig(load_score="requests").balance_threshold == 4
    assert RoutingConfig(balance_threshold=7).balance_threshold == 7
    with pytest.raises(ValueError, match="--dp-load-score"):
        RoutingConfig(load_score="bytes")


# --- served: dp2 -------------------------------------------------------------------------------
LONG_PROMPT = [(11 * i) % 250 + 1 for i in range(4000)]


@pytest.fixture(scope="module")
def server(tiny_llama_long):
    with running_server(tiny_llama_long, *LONG_ARGS, "--strategy", "dp2",
                        "--routing", "load", "--dp-load-score", "tokens") as s:
        yield s


def routed(server, rank: int) -> float:
    return server.metric("parashift_engine_requests_total", f'engine="dp{rank}"') or 0.0


def test_short_prompts_go_around_the_rank_with_the_long_one(server):
    """A 4,000-token prompt that decodes for thousands of steps holds one rank; twenty short
    requests sent meanwhile all go to the other one (by requests, half would join it)."""
    before = [routed(server, r) for r in (0, 1)]
    body = json.dumps({"prompt": LONG_PROMPT, "max_tokens": 4000, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as long_stream:
        for line in long_stream:  # up to its first token: it runs on its rank
            if b'"text"' in line:
                break
        long_rank = 0 if routed(server, 0) > before[0] else 1

        def short(i: int) -> None:
            status, raw = server.request("POST", "/v1/completions", {
                "prompt": [i + 1] * 8, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert status == 200, raw
            assert json.loads(raw)["usage"]["completion_tokens"] == 8

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(short, range(20)))
        # The long one still ran while every short one was routed.
        assert server.metric("parashift_num_requests_running",
                             f'engine="dp{long_rank}"') == 1
    after = [routed(server, r) for r in (0, 1)]
    assert after[long_rank] - before[long_rank] == 1
    assert after[1 - long_rank] - before[1 - long_rank] == 20

"""p1xd1 (issue 57) when a rank dies mid-request, with --restart-dead-engines: requests
queued on the SIGKILLed prefill rank complete on the decode rank, which stands in for the
missing pool; a request decoding on the SIGKILLed decode rank starts over and completes (its
prefill again, its decode wherever a rank serves); a stream that had shown tokens gets the
error event. Nothing hangs, and the surviving rank holds nothing afterwards."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .servers import LONG_ARGS, holds_nothing, running_server

pytestmark = pytest.mark.slow

COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server(tiny_llama_long):
    with running_server(tiny_llama_long, *LONG_ARGS, "--strategy", "p1xd1",
                        "--max-num-seqs", "1", "--restart-dead-engines") as s:
        yield s


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": "hello there", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def wait_metric(server, name: str, engine: str, value: float, what: str) -> None:
    deadline = time.monotonic() + 30
    while server.metric(name, f'engine="{engine}"') != value:
        assert time.monotonic() < deadline, f"{what}:\n{server.output()[-3000:]}"
        time.sleep(0.02)


def wait_healthy(server) -> None:
    deadline = time.monotonic() + 90
    while server.get_json("/health")[0] != 200:
        assert time.monotonic() < deadline, "the rank never came back:\n" + server.output()[-3000:]
        time.sleep(0.2)


def stream_to_end(server, payload: dict, headers: dict, started: threading.Event) -> list[dict]:
    import urllib.request

    req = urllib.request.Request(server.url + COMPLETIONS, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    events = []
    with urllib.request.urlopen(req, timeout=90) as r:
        for line in r:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
                started.set()
    return events


def test_requests_queued_on_a_killed_prefill_rank_complete_on_the_decode_rank(server):
    started = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        # pinned to dp0, it runs there whole and holds its one seat
        pinned = pool.submit(stream_to_end, server, body(7000, stream=True),
                             {"X-data-parallel-rank": "0"}, started)
        assert started.wait(30), "the pinned stream never started"
        queued = [pool.submit(server.request, "POST", COMPLETIONS, body(8), None, 90)
                  for _ in range(3)]
        wait_metric(server, "parashift_num_requests_waiting", "dp0", 3,
                    "the requests never queued on the prefill rank")
        server.engine_process(0).send_signal(signal.SIGKILL)
        for future in queued:
            status, raw = future.result()
            assert status == 200, raw
            assert json.loads(raw)["usage"]["completion_tokens"] == 8
        assert "dp0" in pinned.result()[-1]["error"]["message"]
    assert server.metric("parashift_request_failovers_total", 'outcome="resent"') >= 3
    holds_nothing(server, 1)  # the surviving rank
    wait_healthy(server)


def test_a_request_decoding_on_a_killed_decode_rank_starts_over(server):
    wait_healthy(server)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(server.request, "POST", COMPLETIONS, body(3000), None, 120)
        wait_metric(server, "parashift_num_requests_running", "dp1", 1,
                    "the request never decoded on dp1")
        server.engine_process(1).send_signal(signal.SIGKILL)
        status, raw = future.result()
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 3000
    holds_nothing(server, 0)  # the surviving rank
    wait_healthy(server)

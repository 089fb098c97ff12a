"""Transparent failover on dp2: requests queued on a rank that is SIGKILLed before their first
token complete on the other rank with the outputs that rank gives them; a request that had
streamed gets the error event. Both outcomes are counted in /metrics."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from .servers import LONG_ARGS, running_server

COMPLETIONS = "/v1/completions"
PIN0, PIN1 = {"X-data-parallel-rank": "0"}, {"X-data-parallel-rank": "1"}


@pytest.fixture(scope="module")
def server(tiny_llama_long):
    with running_server(tiny_llama_long, *LONG_ARGS, "--strategy", "dp2",
                        "--max-num-seqs", "1") as s:
        yield s


def queued(prompt: str, stream: bool = False) -> dict:
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def stream_text(raw: bytes) -> tuple[str, list[dict]]:
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices")), events


def test_requests_without_a_token_fail_over_to_the_live_rank(server):
    first_token = threading.Event()
    streamed: dict = {}

    def long_stream() -> None:  # pinned to dp0, it runs there and streams tokens
        import urllib.request
        body = json.dumps({"prompt": "hi", "max_tokens": 7000, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(server.url + COMPLETIONS, data=body, headers={
            "Content-Type": "application/json", **PIN0})
        with urllib.request.urlopen(req, timeout=60) as r:
            lines = []
            for line in r:
                lines.append(line)
                if b'"text"' in line:
                    first_token.set()
            streamed["raw"] = b"".join(lines)

    runner = threading.Thread(target=long_stream, daemon=True)
    runner.start()
    assert first_token.wait(30), "the long stream never started"
    prompts = ["hello there", "a b c", "one more"]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(server.request, "POST", COMPLETIONS,
                               queued(p, stream=i == 2), PIN0, 60)
                   for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 10
        while server.metric("parashift_num_requests_waiting", 'engine="dp0"') != 3:
            assert time.monotonic() < deadline, "the requests never queued on dp0"
            time.sleep(0.02)
        server.engine_process(0).send_signal(signal.SIGKILL)
        results = [f.result() for f in futures]
    runner.join(30)
    assert not runner.is_alive(), "the streamed request hung after the kill"
    _, events = stream_text(streamed["raw"])
    assert "dp0" in events[-1]["error"]["message"]  # it had streamed: the error event

    for prompt, (status, raw), stream in zip(prompts, results, [False, False, True], strict=True):
        assert status == 200, raw
        status, again = server.request("POST", COMPLETIONS, queued(prompt, stream), PIN1)
        if stream:
            text, events = stream_text(raw)
            assert not any("error" in e for e in events), events
            assert text == stream_text(again)[0]
        else:
            reply = json.loads(raw)
            assert reply["usage"]["completion_tokens"] == 8
            assert reply["choices"][0]["text"] == json.loads(again)["choices"][0]["text"]
    assert server.metric("parashift_request_failovers_total", 'outcome="resent"') == 3
    assert server.metric("parashift_request_failovers_total", 'outcome="failed"') == 1
    # The load vector reaches the API server up to 100 ms after the engine freed the blocks.
    deadline = time.monotonic() + 10
    while server.metric("parashift_kv_cache_usage_ratio", 'engine="dp1"') != 0.0:
        assert time.monotonic() < deadline, "dp1 kept KV blocks of finished requests"
        time.sleep(0.02)

"""Admission control against a real server: past --max-waiting-requests a request gets 429
with Retry-After, past --request-timeout it gets 504 (a stream: an error event), and neither
leaks KV blocks."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from .bad_input.conftest import assert_openai_error
from .servers import LONG_ARGS, running_server

COMPLETIONS = "/v1/completions"
LONG = {"prompt": "hi", "max_tokens": 7000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama_long):
    with running_server(tiny_llama_long, *LONG_ARGS, "--max-num-seqs", "1",
                        "--max-waiting-requests", "1", "--request-timeout", "4") as s:
        yield s


def wait_for_metric(server, name: str, value: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.metric(name, 'engine="dp0"') != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def test_a_full_queue_is_429_and_a_slow_request_is_504(server):
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(server.request, "POST", COMPLETIONS, LONG, timeout=60)
        wait_for_metric(server, "parashift_num_requests_running", 1)
        waiting = pool.submit(server.request, "POST", COMPLETIONS, {**LONG, "stream": True},
                              timeout=60)
        wait_for_metric(server, "parashift_num_requests_waiting", 1)
        for stream in (False, True):  # a stream's refusal comes before its headers too
            req = urllib.request.Request(server.url + COMPLETIONS, json.dumps(
                {"prompt": "x", "max_tokens": 2, "stream": stream}).encode(),
                {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=60)
            error = assert_openai_error(refused.value.code, refused.value.read(), 429,
                                        contains=("--max-waiting-requests",))
            assert error["type"] == "rate_limit_error"
            # nothing finished here yet to estimate from: the default, 1 s
            assert refused.value.headers["Retry-After"] == "1"
            assert refused.value.headers["retry-after-ms"] == "1000"
        status, raw = running.result()
        error = assert_openai_error(status, raw, 504, contains=("--request-timeout",))
        status, raw = waiting.result()  # streamed: the headers were out, so an error event
        assert status == 200
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "--request-timeout" in json.loads(events[-2])[
            "error"]["message"]
    wait_for_metric(server, "parashift_num_requests_running", 0)
    status, raw = server.request("POST", COMPLETIONS, {"prompt": "x", "max_tokens": 2})
    assert status == 200, raw
    assert server.metric("parashift_kv_cache_usage_ratio", 'engine="dp0"') == 0.0
    assert server.metric("parashift_requests_total", 'status="timeout"') == 2

"""Overload on dp2 with room for one running and 8 waiting requests per rank, two API servers
and 16 concurrent clients (the measurement in NOTES): with both ranks up every request is
served (a full rank's request moves to the other rank); with one rank killed, a request is
served, after a short wait for room, or gets a 429 that says when to retry, and the openai
client, retrying as it does by default, completes every request."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from .servers import TINY_ARGS, running_server

NUM_CLIENTS = 16
NUM_REQUESTS = 160
BODY = {"prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, *TINY_ARGS, "--strategy", "dp2", "--max-num-seqs", "1",
                        "--api-server-count", "2") as s:
        yield s


def post(server, body: dict) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def all_at_once(server) -> list[tuple[int, dict[str, str], bytes]]:
    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        return list(pool.map(lambda _: post(server, BODY), range(NUM_REQUESTS)))


def test_with_both_ranks_up_every_request_is_served(server):
    answers = all_at_once(server)
    assert [status for status, _, _ in answers] == [200] * NUM_REQUESTS, [
        raw for status, _, raw in answers if status != 200][:3]


def scrapes_say_dp1_is_down(server) -> bool:
    """Whether both API servers (each scrape answers from one of them) count dp1 down."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while len(seen) < 2:
        assert time.monotonic() < deadline, "a scrape never came from both API servers"
        _, raw = server.request("GET", "/metrics")
        text = raw.decode()
        index = next(line for line in text.splitlines()
                     if line.startswith("parashift_api_server{"))
        seen[index] = server.metric("parashift_engine_up", 'engine="dp1"')
    return all(up == 0 for up in seen.values())


def test_with_one_rank_down_a_429_says_when_to_retry_and_the_client_retries(server):
    server.engine_process(1).send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not scrapes_say_dp1_is_down(server):
        assert time.monotonic() < deadline, "the API servers never heard of dp1's death"
        time.sleep(0.05)

    answers = all_at_once(server)
    refused = [(headers, raw) for status, headers, raw in answers if status == 429]
    assert {status for status, _, _ in answers} <= {200, 429}, [
        raw for status, _, raw in answers if status not in (200, 429)][:3]
    for headers, raw in refused:
        assert int(headers["Retry-After"]) >= 1 and int(headers["retry-after-ms"]) >= 1
        assert json.loads(raw)["error"]["type"] == "rate_limit_error"

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")  # max_retries=2
    assert client.max_retries == 2

    def ask(_: int) -> str:
        reply = client.completions.create(model=server.model_name, prompt="hello",
                                          max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        return reply.choices[0].finish_reason

    with ThreadPoolExecutor(NUM_CLIENTS) as pool:
        assert list(pool.map(ask, range(NUM_REQUESTS))) == ["length"] * NUM_REQUESTS

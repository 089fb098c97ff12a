"""p1xd1 over two nodes (issue 57): the head runs the API server and the prefill rank dp0, a
`--headless` launcher in another process tree runs the decode rank dp1; they meet only over
TCP on 127.0.0.1 under the cluster secret, as two machines would, each with its own host
tier. dp1 fetches a prompt's blocks from the head's KV server (CURVE, rank keys only) and
gives the answers dp0 gives alone, bit for bit under --deterministic. A stranger on the KV
port, with no secret or with the secret but no rank's key, is answered nothing, and the
server goes on serving."""

from __future__ import annotations

import json
import time

import pytest

from parashift.wire import protocol as p

from .conftest import strangers_get_nothing
from .servers import TINY_ARGS, launch, stop, wait_serving

pytestmark = pytest.mark.slow

SECRET = "pools-over-nodes-secret-0123456789"
ARGS = [*TINY_ARGS, "--deterministic", "--strategy", "p1xd1", "--data-parallel-size-local",
        "1", "--data-parallel-address", "127.0.0.1"]
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(70 + 9 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def nodes(tiny_llama):
    head = launch(tiny_llama, [*ARGS, "--data-parallel-rpc-port", "0"],
                  env={"PARASHIFT_CLUSTER_SECRET": SECRET})
    node = None
    try:
        port = head.wait_line(r"handshake listens at tcp://127\.0\.0\.1:(\d+)").group(1)
        kv_server = head.wait_line(r"KV server listens at (tcp://127\.0\.0\.1:\d+)").group(1)
        node = launch(tiny_llama, [*ARGS, "--headless", "--data-parallel-start-rank", "1",
                                   "--data-parallel-rpc-port", port],
                      env={"PARASHIFT_CLUSTER_SECRET": SECRET})
        yield wait_serving(head), kv_server
    finally:
        if node is not None:
            stop(node)
        stop(head)


def complete(server, prompt: list[int], rank: int | None = None) -> dict:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    status, raw = server.request("POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "logprobs": 2}, headers=headers, timeout=120)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    return {"text": choice["text"], "logprobs": choice["logprobs"]}


def remote_loads(server) -> float:
    return server.metric("parashift_kv_tier_loads", 'engine="dp1",tier="remote"') or 0.0


def wait_remote_loads(server, above: float) -> None:
    deadline = time.monotonic() + 30
    while remote_loads(server) <= above:
        assert time.monotonic() < deadline, "dp1 fetched nothing:\n" + server.output()[-3000:]
        time.sleep(0.05)


def test_the_decode_rank_on_another_node_fetches_the_prompts_blocks(nodes):
    head, _ = nodes
    for prompt in PROMPTS:
        loads = remote_loads(head)
        handed = complete(head, prompt)  # dp0 prefills, dp1 (the other node) decodes
        wait_remote_loads(head, loads)
        assert handed == complete(head, prompt, rank=0)  # dp0 alone: the same bits


def test_a_stranger_on_the_kv_port_gets_nothing(nodes, monkeypatch):
    head, kv_server = nodes
    # dropped from a peer with the secret: only a rank's engine reads prompts' KV
    strangers_get_nothing(kv_server, [p.encode(p.KVFetch(0, [1, 2, 3]))], SECRET, monkeypatch)
    loads = remote_loads(head)
    prompt = [(11 * j) % 250 + 3 for j in range(90)]
    complete(head, prompt)  # still serving
    wait_remote_loads(head, loads)

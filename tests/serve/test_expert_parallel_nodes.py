"""dp2xep over two nodes (issue 58): the head runs the API server and dp0, a `--headless`
launcher in another process tree runs dp1; they meet only over TCP on 127.0.0.1 under the
cluster secret, as two machines would. The expert group's store is the head launcher's (CURVE,
rank keys only) and its address travels in the handshake; the dispatch runs over gloo as on one
node. MoE requests give what one engine holding every expert gives (which one-node dp2xep gives
too: test_expert_parallel.py). A stranger on the store's port is answered nothing; an engine
killed on either tree fails the group's requests in flight with an error, and the restarted
group meets at a new store and serves again; a node lost whole takes its rank, the head goes
on answering, and a node started again brings the group back."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import time

import pytest

from parashift.wire import protocol as p
from parashift.wire.store_protocol import StoreCall

from .conftest import strangers_get_nothing
from .servers import fork_server_folder, launch, stop, wait_serving
from .test_expert_parallel import PROMPTS, assert_matches, complete, reference, stream_in_thread

pytestmark = pytest.mark.slow

SECRET = "experts-over-nodes-secret-0123456789"
ARGS = ["--dtype", "float32", "--max-model-len", "4096", "--kv-cache-memory", "32MiB",
        "--strategy", "dp2xep", "--data-parallel-size-local", "1",
        "--data-parallel-address", "127.0.0.1", "--restart-dead-engines",
        "--heartbeat-timeout", "5"]


@contextlib.contextmanager
def two_trees(model: str):
    env = {"PARASHIFT_CLUSTER_SECRET": SECRET}
    head = launch(model, [*ARGS, "--data-parallel-rpc-port", "0"], env=env)
    node = None
    try:
        port = head.wait_line(r"handshake listens at tcp://127\.0\.0\.1:(\d+)").group(1)
        store = head.wait_line(r"expert group's store listens at (tcp://\S+)").group(1)
        node = launch(model, [*ARGS, "--headless", "--data-parallel-start-rank", "1",
                              "--data-parallel-rpc-port", port], env=env)
        head.node = node  # type: ignore[attr-defined]
        yield wait_serving(head), store
    finally:
        if node is not None:
            stop(node)
        stop(head)


@pytest.fixture(scope="module")
def mixtral_nodes(tiny_model_factory):
    model = tiny_model_factory("mixtral", max_position_embeddings=8192)
    with two_trees(model) as (server, store):
        yield model, server, store


def test_mixtral_over_two_nodes_matches_one_engine_with_every_expert(mixtral_nodes):
    model, server, _ = mixtral_nodes
    assert_matches(server, reference(model), [0, 1])


def test_qwen2_moe_over_two_nodes_matches_one_engine_with_every_expert(tiny_model_factory):
    model = tiny_model_factory("qwen2_moe", max_position_embeddings=8192)
    with two_trees(model) as (server, _):
        assert_matches(server, reference(model), [0, 1])


def test_a_stranger_on_the_store_port_gets_nothing(mixtral_nodes, monkeypatch):
    _, server, store = mixtral_nodes
    call = p.encode(StoreCall(0, "set", ["ep-tp0/0"], value=b"a stranger's address"))
    strangers_get_nothing(store, [call, b"junk"], SECRET, monkeypatch)
    deadline = time.monotonic() + 30
    while "dropped a frame from cluster on the expert-store link" not in server.output():
        assert time.monotonic() < deadline, server.output()[-3000:]
        time.sleep(0.05)
    for rank in (0, 1):  # still serving, both ranks
        assert complete(server, PROMPTS[1], rank=rank, max_tokens=2)


@pytest.mark.parametrize("where", ["second node", "head"])
def test_an_engine_killed_fails_the_groups_requests_and_the_group_comes_back(mixtral_nodes,
                                                                              where):
    """dp1 killed on the second tree, or dp0 on the head's: both ranks' streams end with an
    error, the head stops the group (on the other tree too, where a live rank of it is
    left) and the restarted group meets at a new store and serves."""
    _, server, _ = mixtral_nodes
    node = server.node  # type: ignore[attr-defined]
    stops = server.output().count("of the expert-parallel group died: stopping the group")
    body = {"prompt": [(7 * j) % 250 + 1 for j in range(16)], "max_tokens": 4000,
            "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        streams = [stream_in_thread(pool, server, body, rank) for rank in (0, 1)]
        for f in streams:
            assert f.first_event.wait(60) and not f.done(), f.result()
        victim = node.engine_process(1) if where == "second node" else server.engine_process(0)
        os.kill(victim.pid, signal.SIGKILL)
        results = [f.result() for f in streams]
    for status, raw in results:
        events = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert status == 200 and events[-1] == "data: [DONE]", raw[-500:]
        assert "engine dp" in json.loads(events[-2][6:])["error"]["message"], raw[-500:]
    deadline = time.monotonic() + 120
    while (server.output().count("of the expert-parallel group died: stopping the group")
           == stops or server.get_json("/health")[0] != 200):
        assert time.monotonic() < deadline, server.output()[-4000:] + node.output()[-3000:]
        time.sleep(0.2)
    for rank in (0, 1):
        assert complete(server, PROMPTS[0], rank=rank, max_tokens=2)


def test_a_node_that_leaves_takes_its_rank_and_the_head_goes_on(mixtral_nodes):
    """The second tree is killed whole (a machine lost): the head hears no heartbeat from dp1,
    stops the group and answers all along, /health naming the rank down; a node started again
    takes dp1 back and the group serves."""
    model, server, _ = mixtral_nodes
    node = server.node  # type: ignore[attr-defined]
    tree = node.current_tree()
    socket_folder = fork_server_folder(tree)
    for proc in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    node.proc.wait(30)
    shutil.rmtree(socket_folder)  # a machine lost takes its /tmp along
    deadline = time.monotonic() + 60  # the heartbeat timeout (5 s), then the verdict
    while (health := server.get_json("/health"))[0] == 200:
        assert time.monotonic() < deadline, server.output()[-4000:]
        time.sleep(0.2)
    assert health[0] == 503 and "dp1" in health[1]["detail"], health
    port = server.wait_line(r"handshake listens at tcp://127\.0\.0\.1:(\d+)").group(1)
    again = launch(model, [*ARGS, "--headless", "--data-parallel-start-rank", "1",
                           "--data-parallel-rpc-port", port],
                   env={"PARASHIFT_CLUSTER_SECRET": SECRET})
    try:
        deadline = time.monotonic() + 120
        while server.get_json("/health")[0] != 200:
            assert time.monotonic() < deadline, server.output()[-4000:] + again.output()[-3000:]
            time.sleep(0.2)
        for rank in (0, 1):
            assert complete(server, PROMPTS[2], rank=rank, max_tokens=2)
    finally:
        stop(again)

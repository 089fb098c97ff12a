"""The multi-node flags (which ranks a node runs), the socket addresses of both launch modes,
and the restart backoff of a node's engines."""

from __future__ import annotations

import os
import time

import pytest
import zmq

from parashift.engine.args import EngineArgs
from parashift.engine.placement import node_mesh
from parashift.runtime.endpoints import Endpoints
from parashift.runtime.local_engines import LocalEngines
from parashift.runtime.node import ServeArgs
from parashift.runtime.restart_policy import FIRST_RESTART_DELAY_S
from parashift.strategies.spec import StrategySpec
from parashift.wire.sockets import bind


def serve_args(**kwargs) -> ServeArgs:
    return ServeArgs(EngineArgs(), **kwargs)


def test_local_ranks_of_head_and_headless_nodes():
    assert serve_args().local_ranks(4) == [0, 1, 2, 3]
    head = serve_args(data_parallel_size_local=2)
    assert head.local_ranks(4) == [0, 1] and head.multi_node(4)
    node = serve_args(headless=True, data_parallel_start_rank=2)
    assert node.local_ranks(4) == [2, 3] and node.multi_node(4)
    assert not serve_args().multi_node(4)
    assert serve_args(data_parallel_address="127.0.0.1").multi_node(2)


@pytest.mark.parametrize("kwargs, message", [
    ({"headless": True}, "--headless needs --data-parallel-start-rank >= 1"),
    ({"data_parallel_start_rank": 1}, "is for --headless nodes"),
    ({"data_parallel_size_local": 0}, "do not fit"),
    ({"headless": True, "data_parallel_start_rank": 3, "data_parallel_size_local": 2},
     "--data-parallel-start-rank 3 and --data-parallel-size-local 2 do not fit in "
     "--data-parallel-size 4"),
    ({"heartbeat_timeout": 0.5}, "--heartbeat-timeout"),
])
def test_bad_multi_node_flags_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        serve_args(**kwargs).local_ranks(4)


def test_endpoints_local_and_tcp():
    local = Endpoints.local(2)
    try:
        assert local.handshake.startswith("ipc://") and len(local.requests) == 2
        assert len(set(local.requests + local.outputs)) == 4
    finally:
        local.remove()
    tcp = Endpoints.tcp("127.0.0.1", 29550, 2)
    try:
        assert tcp.handshake == "tcp://127.0.0.1:29550"
        every = [tcp.handshake, *tcp.requests, *tcp.outputs, tcp.coordinator_load,
                 tcp.coordinator_publish]
        assert len(set(every)) == 7 and all(a.startswith("tcp://127.0.0.1:") for a in every)
        # Every port but the handshake's is held bound until its process takes it over.
        assert set(tcp.bound) == set(every[1:])
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        bind(pull, tcp.requests[0], tcp.handed(tcp.requests[0]))
        push = ctx.socket(zmq.PUSH)
        push.connect(tcp.requests[0])
        push.send(b"on the handed-over socket")
        assert pull.recv() == b"on the handed-over socket"
        ctx.destroy(linger=0)
    finally:
        tcp.remove()
    with pytest.raises(ValueError, match="--data-parallel-address 203.0.113.7"):
        Endpoints.tcp("203.0.113.7", 29550, 1)


def test_this_nodes_cores_are_split_between_its_engines_and_workers():
    cores = set(os.sched_getaffinity(0))
    mesh = node_mesh(StrategySpec.parse("dp4"), "cpu", [2, 3])
    mine, theirs = (set(mesh.engine_placement(r).cpu_ids) for r in (2, 3))
    assert mine and theirs and mine | theirs <= cores
    if len(cores) >= 2:
        assert not mine & theirs
    tp = node_mesh(StrategySpec.parse("dp2xtp2"), "cpu", [0, 1])
    for rank in (0, 1):
        placement = tp.engine_placement(rank)
        assert [w.process_name for w in placement.workers] == [
            f"parashift-worker-dp{rank}-tp0", f"parashift-worker-dp{rank}-tp1"]
        assert set(placement.cpu_ids) == {c for w in placement.workers for c in w.cpu_ids}
        if len(cores) >= 2:
            assert placement.workers[0].cpu_ids != placement.workers[1].cpu_ids


def test_a_headless_node_with_8_gpus_places_its_workers_on_cuda_4_to_7(monkeypatch):
    """-dpl 2 -dpr 2 at tp2: the launcher's mesh (only the GPU count is mocked) and plan's."""
    import json
    import subprocess
    import sys

    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    args = serve_args(headless=True, data_parallel_start_rank=2, data_parallel_size_local=2)
    mesh = node_mesh(StrategySpec.parse("dp4xtp2"), "cuda", args.local_ranks(4))
    devices = [w.device for r in (2, 3) for w in mesh.engine_placement(r).workers]
    assert devices == ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]
    assert [w.cuda_index for w in mesh.engine_placement(3).workers] == [6, 7]
    done = subprocess.run([sys.executable, "-m", "parashift.cli", "plan", "Qwen3-8B",
                           "--strategy", "dp4xtp2", "--device", "h100-80g", "--json"],
                          capture_output=True, text=True, timeout=120)
    planned = {r["process_name"]: r["device"] for r in json.loads(done.stdout)["mesh"]}
    assert {w.process_name: w.device for w in mesh.ranks} == {
        name: device for name, device in planned.items() if "dp2" in name or "dp3" in name}


@pytest.mark.slow
def test_a_rank_that_keeps_dying_is_restarted_with_a_growing_delay(tmp_path):
    """A real engine process with nobody at its handshake address gives up and exits; the
    supervisor restarts it after 1 s, then after 2 s (runtime/restart_policy.py has the rule's
    unit tests)."""
    placement = node_mesh(StrategySpec.parse("dp1"), "cpu", [0]).engine_placement(0)
    engines = LocalEngines({0: placement}, f"ipc://{tmp_path}/nobody", "ERROR",
                           handshake_timeout=0.1, restart=True)
    delays = []
    try:
        engines.start()
        deadline = time.monotonic() + 120
        while len(delays) < 2:
            assert time.monotonic() < deadline
            for death in engines.reap():
                assert death.rank == 0 and "exited with code 1" in death.reason
                delays.append(engines.restarts.delay[0])
            engines.restart_due()
            time.sleep(0.05)
    finally:
        engines.stop()
    assert delays == [FIRST_RESTART_DELAY_S, 2 * FIRST_RESTART_DELAY_S]


def test_ray_placement_packs_a_rank_and_spreads_the_ranks():
    from parashift.runtime.ray_cluster import rank_bundles
    from parashift.runtime.ray_nodes import place
    from parashift.strategies.layout import ProcessPlan

    nodes = [{"address": f"10.0.0.{i}", "node_id": f"n{i}", "resources": {"CPU": 8.0}}
             for i in (1, 2)]
    # dp rank: engine core + two tp workers, 3 CPUs
    bundles = rank_bundles(ProcessPlan(workers_per_engine=2), gpu=False)
    placed = place(nodes, bundles, 3)
    assert [p.node for p in placed] == ["10.0.0.1", "10.0.0.2", "10.0.0.1"]
    assert place(nodes, bundles, 6)[-1].node is None  # 6 x 3 CPUs > 16: no room for dp5
    assert rank_bundles(ProcessPlan(), gpu=True) == [{"CPU": 1.0, "GPU": 1.0}]

"""The multi-node flags (which ranks a node runs), the socket addresses of both launch modes,
and the restart backoff of a node's engines."""

from __future__ import annotations

import os
import time

import pytest

from parashift.engine.args import EngineArgs
from parashift.runtime.endpoints import Endpoints, free_ports
from parashift.runtime.local_engines import LocalEngines
from parashift.runtime.node import ServeArgs, local_cpu_shares
from parashift.runtime.restart_policy import FIRST_RESTART_DELAY_S
from parashift.strategies.mesh import DeviceMesh
from parashift.strategies.spec import StrategySpec


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
    assert tcp.handshake == "tcp://127.0.0.1:29550"
    every = [tcp.handshake, *tcp.requests, *tcp.outputs, tcp.coordinator_load,
             tcp.coordinator_publish]
    assert len(set(every)) == 7 and all(a.startswith("tcp://127.0.0.1:") for a in every)
    with pytest.raises(ValueError, match="--data-parallel-address 203.0.113.7"):
        free_ports("203.0.113.7", 1)


def shares_of(ranks: list[int], tp: int, device: str, num_threads: int | None = None):
    units = len(os.sched_getaffinity(0)) if device == "cpu" else 8
    mesh = DeviceMesh(StrategySpec.from_sizes(dp=len(ranks), tp=tp), devices_per_node=units,
                      device_type=device, first_dp_rank=ranks[0])
    return local_cpu_shares(mesh, num_threads)


def test_cpu_shares_split_this_nodes_cores():
    shares = shares_of([2, 3], 1, "cpu")
    mine, theirs = set(shares[2].cpu_ids), set(shares[3].cpu_ids)
    assert mine and theirs and mine | theirs <= os.sched_getaffinity(0)
    if len(os.sched_getaffinity(0)) >= 2:
        assert not mine & theirs
    assert shares[2].num_threads == len(shares[2].cpu_ids)
    assert shares_of([0], 1, "cpu", 3)[0].cpu_ids == []  # alone: all cores, unpinned
    assert shares_of([0, 1], 1, "cuda")[1].cpu_ids == []
    # dp2 x tp2: each worker one core; a rank's two workers on different cores when possible.
    tp = shares_of([0, 1], 2, "cpu")
    for share in tp.values():
        assert len(share.workers) == 2 and all(len(w) >= 1 for w in share.workers)
        assert set(share.cpu_ids) == {c for w in share.workers for c in w}
        if len(os.sched_getaffinity(0)) >= 2:
            assert share.workers[0] != share.workers[1]


@pytest.mark.slow
def test_a_rank_that_keeps_dying_is_restarted_with_a_growing_delay(tmp_path):
    """A real engine process with nobody at its handshake address gives up and exits; the
    supervisor restarts it after 1 s, then after 2 s."""
    engines = LocalEngines([0], f"ipc://{tmp_path}/nobody", {}, "ERROR", handshake_timeout=0.1,
                           restart=True)
    delays = []
    try:
        engines.start()
        deadline = time.monotonic() + 120
        while len(delays) < 2:
            assert time.monotonic() < deadline
            for death in engines.reap():
                assert death.rank == 0 and "exited with code 1" in death.reason
                delays.append(engines.restart_at[0] - time.monotonic())
            engines.restart_due()
            time.sleep(0.05)
    finally:
        engines.stop()
    assert delays[0] == pytest.approx(FIRST_RESTART_DELAY_S, abs=0.2)
    assert delays[1] == pytest.approx(2 * FIRST_RESTART_DELAY_S, abs=0.2)


def test_ray_placement_packs_a_rank_and_spreads_the_ranks():
    from parashift.runtime.ray_cluster import rank_bundles
    from parashift.strategies.layout import ProcessPlan
    from parashift.runtime.ray_nodes import place

    nodes = [{"address": f"10.0.0.{i}", "node_id": f"n{i}", "resources": {"CPU": 8.0}}
             for i in (1, 2)]
    bundles = rank_bundles(ProcessPlan(workers_per_engine=2), gpu=False)  # dp rank: engine core + two tp workers, 3 CPUs
    placed = place(nodes, bundles, 3)
    assert [p.node for p in placed] == ["10.0.0.1", "10.0.0.2", "10.0.0.1"]
    assert place(nodes, bundles, 6)[-1].node is None  # 6 x 3 CPUs > 16: no room for dp5
    assert rank_bundles(ProcessPlan(), gpu=True) == [{"CPU": 1.0, "GPU": 1.0}]

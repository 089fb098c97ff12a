"""DeviceMesh: placement, coordinates, groups and clear errors."""

from __future__ import annotations

import dataclasses

import pytest

from parashift.strategies.data import DataParallel
from parashift.strategies.mesh import DeviceMesh
from parashift.strategies.spec import StrategySpec


def mesh(text: str, **kw) -> DeviceMesh:
    return DeviceMesh(StrategySpec.parse(text), **kw)


def test_dp4xtp2_on_two_gpu_nodes():
    m = mesh("dp4xtp2", num_nodes=2, devices_per_node=4, device_type="cuda")
    assert m.world_size == 8
    assert [(r.node, r.device, r.coord("dp"), r.coord("tp")) for r in m.ranks[:4]] == [
        (0, "cuda:0", 0, 0), (0, "cuda:1", 0, 1), (0, "cuda:2", 1, 0), (0, "cuda:3", 1, 1)]
    assert m.ranks[4].node == 1 and m.ranks[4].device == "cuda:0"
    assert m.group("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # dp replicas exchange no tensors: no process group spans them
    assert [g.name for g in m.spec.groups()] == ["pp", "tp"]
    with pytest.raises(KeyError, match="no 'dp' group; it has pp, tp"):
        m.group("dp")
    # a group over the axis that spans engines: ep's, one per tp coordinate
    ep = mesh("dp4xtp2xep", num_nodes=2, devices_per_node=4, device_type="cuda")
    assert ep.group("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert m.ranks[3].process_name == "parashift-worker-dp1-tp1"
    assert "cuda:3" in m.table()


def test_dp_only_ranks_are_engines_with_their_cores():
    m = mesh("dp2", devices_per_node=4)  # CPU: devices_per_node counts cores
    assert [r.process_name for r in m.ranks] == ["parashift-engine-dp0", "parashift-engine-dp1"]
    assert [r.device for r in m.ranks] == ["cpu[0-1]", "cpu[2-3]"]


def test_pp_groups():
    m = mesh("dp2xpp2", devices_per_node=4, device_type="cuda")
    assert m.group("pp") == [[0, 1], [2, 3]]
    assert m.ranks[1].process_name == "parashift-worker-dp0-pp1"


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="needs 8 devices; 1 node"):
        mesh("dp4xtp2", devices_per_node=4, device_type="cuda")
    with pytest.raises(ValueError, match="keeps 2 core"):
        DeviceMesh(StrategySpec(tuple(a if a.name != "dp" else KeepTwo(1)
                                      for a in StrategySpec.parse("dp1").axes)), 2)
    split = mesh("dp3xtp4", num_nodes=2, devices_per_node=6, device_type="cuda")
    assert any("span nodes" in w for w in split.warnings)


class KeepTwo(DataParallel):
    def processes(self, plan):
        return dataclasses.replace(super().processes(plan), reserved_cpus=2)


def test_a_headless_node_places_its_ranks_after_the_heads():
    """-dpl 2 -dpr 2 at tp2 on an 8-GPU node: the GPUs of ranks 2 and 3, as `plan` shows."""
    m = mesh("dp4xtp2", devices_per_node=8, device_type="cuda", engines=[2, 3])
    assert [r.device for r in m.ranks] == ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]
    assert m.engine_placement(3).workers[1].process_name == "parashift-worker-dp3-tp1"


def test_oversubscribed_cpu_says_so():
    m = mesh("tp3", devices_per_node=2)
    assert [r.cpu_ids for r in m.ranks] == [(0,), (1,), (0,)]
    assert "oversubscribed" in m.warnings[0] and "oversubscribed" in m.table()


def test_reserved_cores_go_to_the_api_servers():
    m = DeviceMesh(StrategySpec((KeepOne(2),) + StrategySpec.parse("dp1").axes[1:]), 4)
    assert m.api_server_cpus == (0,)
    assert [r.cpu_ids for r in m.ranks] == [(1,), (2,)]
    assert m.engine_placement(0).cpu_ids == (1,)


class KeepOne(DataParallel):
    def processes(self, plan):
        return dataclasses.replace(super().processes(plan), reserved_cpus=1)


class TooManyEngines(DataParallel):
    def processes(self, plan):
        planned = super().processes(plan)
        return dataclasses.replace(planned, num_engines=planned.num_engines + 1)


def test_hooks_that_disagree_are_an_error():
    spec = StrategySpec((TooManyEngines(2),) + StrategySpec.parse("dp1").axes[1:])
    with pytest.raises(ValueError, match="mesh axes make 2 ranks but its processes hooks "
                                         "launch 3 engine"):
        DeviceMesh(spec, 4)

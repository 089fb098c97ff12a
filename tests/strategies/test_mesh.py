"""DeviceMesh: placement, coordinates, groups and clear errors."""

from __future__ import annotations

import pytest

from parashift.strategies.mesh import DeviceMesh
from parashift.strategies.spec import StrategySpec


def mesh(text: str, **kw) -> DeviceMesh:
    return DeviceMesh(StrategySpec.parse(text), **kw)


def test_dp4xtp2_on_two_gpu_nodes():
    m = mesh("dp4xtp2", num_nodes=2, devices_per_node=4, device_type="cuda")
    assert m.world_size == 8
    assert [(r.node, r.device, r.dp, r.tp) for r in m.ranks[:4]] == [
        (0, "cuda:0", 0, 0), (0, "cuda:1", 0, 1), (0, "cuda:2", 1, 0), (0, "cuda:3", 1, 1)]
    assert m.ranks[4].node == 1 and m.ranks[4].device == "cuda:0"
    assert m.group("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.group("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
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
    with pytest.raises(ValueError, match="tp4 group of a rank must fit on one node"):
        mesh("dp3xtp4", num_nodes=2, devices_per_node=8, device_type="cuda")

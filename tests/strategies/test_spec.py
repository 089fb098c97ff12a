"""The strategy grammar, validation against a model, flags vs --strategy, and plugins."""

from __future__ import annotations

import sys

import pytest
from conftest import install_strategy_plugin, tiny_config

from parashift.engine.args import EngineArgs, create_config, strategy_spec
from parashift.strategies.mesh import DeviceMesh
from parashift.strategies.spec import StrategySpec


@pytest.mark.parametrize("text,canonical", [
    ("dp4xtp2", "dp4xtp2"), ("tp2xdp4", "dp4xtp2"), ("TP8", "tp8"), ("dp8xep", "dp8xep"),
    ("ep x dp2".replace(" ", ""), "dp2xep"), ("dp2xtp2xpp2", "dp2xpp2xtp2"), ("dp1", "dp1"),
    ("dp1xtp1", "dp1"), ("dp2xtp1", "dp2"),
])
def test_good_specs_round_trip(text, canonical):
    spec = StrategySpec.parse(text)
    assert spec.canonical == canonical
    assert StrategySpec.parse(spec.canonical).canonical == canonical


def test_sizes_and_world_size():
    spec = StrategySpec.parse("dp4xtp2xpp2")
    assert (spec.size("dp"), spec.size("tp"), spec.size("pp"), spec.size("ep")) == (4, 2, 2, 0)
    assert spec.world_size == 16
    assert StrategySpec.from_sizes(dp=2, tp=1).canonical == "dp2"


@pytest.mark.parametrize("text,message", [
    ("", "empty"), ("dp0", "size >= 1"), ("dp", "size >= 1"), ("tp2xtp4", "given twice"),
    ("ep2", "flag and takes no size"), ("cp2", "unknown axis 'cp2'; known: dpN, ppN, tpN, ep"),
    ("dp2-tp2", "unknown axis"),
])
def test_bad_specs(text, message):
    with pytest.raises(ValueError, match=message):
        StrategySpec.parse(text)


def test_validation_against_the_model():
    cfg = tiny_config("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                      intermediate_size=96)
    StrategySpec.parse("dp4").validate(cfg)  # data parallel fits any model
    with pytest.raises(ValueError, match=r"tp4 needs num_attention_heads \(9\) divisible by 4"):
        StrategySpec.parse("tp4").validate(cfg)
    StrategySpec.parse("dp2xtp3").validate(cfg)  # 9 heads, 3 kv heads: tp3 fits
    StrategySpec.parse("pp2").validate(cfg)  # 2 layers, 2 stages
    with pytest.raises(ValueError, match="pp4 needs at least 4 layers"):
        StrategySpec.parse("pp4").validate(cfg)
    with pytest.raises(ValueError, match="no experts"):
        StrategySpec.parse("dp2xep").validate(cfg)


def test_flags_and_strategy_are_interchangeable(tiny_llama):
    by_flag = create_config(EngineArgs(model=tiny_llama, data_parallel_size=2)).parallel
    by_spec = create_config(EngineArgs(model=tiny_llama, strategy="dp2")).parallel
    assert str(by_flag.strategy) == str(by_spec.strategy) == "dp2"
    assert by_spec.strategy.processes().num_engines == 2
    agreeing = EngineArgs(model=tiny_llama, strategy="dp2", data_parallel_size=2)
    assert create_config(agreeing).parallel.strategy.processes().num_engines == 2
    with pytest.raises(ValueError, match="--strategy dp2 sets dp=2 but --data-parallel-size is 4"):
        create_config(EngineArgs(model=tiny_llama, strategy="dp2", data_parallel_size=4))
    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        strategy_spec(EngineArgs(model=tiny_llama, strategy="dp2", enable_expert_parallel=True))


def test_offline_llm_refuses_data_parallel(tiny_llama):
    from parashift import LLM

    with pytest.raises(ValueError, match="parashift run --strategy dpN"):
        LLM(tiny_llama, strategy="dp2")


PLUGIN = '''
import dataclasses

from parashift.strategies.base import Strategy
from parashift.strategies.layout import GroupSpec, MeshAxis


class ContextParallel(Strategy):
    """A sequence split over ranks inside an engine (for the mesh and the plan)."""

    name, axis = "cp", "context"

    def check_model(self, hf_config):
        return [] if self.size <= 4 else [f"cp{self.size}: at most 4"]

    def mesh(self):
        return MeshAxis("cp", self.size, spans_engines=False)

    def groups(self):
        return [GroupSpec("cp", ("cp",))]

    def shard(self, plan, at, hf_config):
        return plan

    def cost(self, cost, plan):
        return cost

    def processes(self, plan):
        return dataclasses.replace(plan, workers_per_engine=plan.workers_per_engine * self.size)


class HalfDone(Strategy):
    """Parses and validates, but says nothing of where its ranks go."""

    name, axis = "hd", "half"

    def check_model(self, hf_config):
        return []

    def groups(self):
        return []
'''


@pytest.fixture
def plugin_package(tmp_path, monkeypatch):
    """A package installed the way pip would: a module plus dist-info with an entry point."""
    monkeypatch.syspath_prepend(install_strategy_plugin(tmp_path, "fake_cp_plugin", PLUGIN,
                                                        "cp", "ContextParallel"))
    yield
    sys.modules.pop("fake_cp_plugin", None)


def test_entry_point_plugin_is_found_and_used(plugin_package):
    spec = StrategySpec.parse("cp2xdp2")
    assert spec.canonical == "dp2xcp2"
    assert spec.size("cp") == 2
    with pytest.raises(ValueError, match="cp8: at most 4"):
        StrategySpec.parse("cp8").validate(tiny_config("llama"))
    # It shapes the layout: its own mesh axis and group, two workers per engine.
    assert spec.processes().workers_per_engine == 2 and spec.world_size == 4
    mesh = DeviceMesh(spec, 4)
    assert mesh.group("cp") == [[0, 1], [2, 3]]
    assert mesh.ranks[1].process_name == "parashift-worker-dp0-cp1"
    # ... and it travels as itself (class and size), not as integers.
    assert str(StrategySpec.from_wire(spec.to_wire())) == "dp2xcp2"


def test_a_plugin_missing_hooks_is_refused_at_parse_time(tmp_path, monkeypatch):
    (tmp_path / "half_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"'hd' \(half_plugin:HalfDone\) does not implement "
                                         r"the hook\(s\) mesh, shard, cost, processes"):
        StrategySpec.parse("hd2", extra=["half_plugin:HalfDone"])


def test_module_class_plugin(tmp_path, monkeypatch):
    (tmp_path / "direct_cp_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = StrategySpec.parse("cp3", extra=["direct_cp_plugin:ContextParallel"])
    assert spec.canonical == "cp3"
    with pytest.raises(ValueError, match="cannot load strategy"):
        StrategySpec.parse("dp2", extra=["no_such_module:X"])

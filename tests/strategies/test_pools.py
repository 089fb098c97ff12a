"""Prefill/decode pools in the strategy grammar (`pPxdD`, issue 57): the dp axis split into two
pools, canonical forms, what is refused, the processes a launch runs, the spec over the wire,
and the host tier the hand-off needs, sized by default."""

from __future__ import annotations

import pytest
from conftest import tiny_config

from parashift.defaults import DEFAULT_HANDOFF_TIER
from parashift.engine.args import EngineArgs, create_config
from parashift.strategies.disaggregated import engine_pool
from parashift.strategies.mesh import DeviceMesh
from parashift.strategies.spec import StrategySpec


@pytest.mark.parametrize("text,canonical,engines,prefill", [
    ("p1xd1", "p1xd1", 2, 1), ("d2xp1xtp2", "p1xd2xtp2", 3, 1), ("tp2xp2xd2", "p2xd2xtp2", 4, 2),
])
def test_pools_parse_and_travel(text, canonical, engines, prefill):
    spec = StrategySpec.parse(text)
    assert spec.canonical == canonical and StrategySpec.parse(canonical).canonical == canonical
    plan = spec.processes()
    assert (plan.num_engines, plan.prefill_engines, plan.coordinator) == (engines, prefill, True)
    assert spec.size("dp") == engines
    again = StrategySpec.from_wire(spec.to_wire())
    assert again.canonical == canonical and again.processes() == plan
    mesh = DeviceMesh(spec, devices_per_node=spec.world_size)
    assert mesh.num_engines == engines and len(mesh.ranks) == spec.world_size
    assert StrategySpec.parse("dp2").processes().prefill_engines == 0


@pytest.mark.parametrize("text,message", [
    ("p1", "need both p and d"), ("d2", "need both p and d"), ("p1xd1xdp2", "without dp"),
    ("p1xd1xep", "expert parallel"), ("p0xd1", "size >= 1"), ("p1xd1xd2", "given twice"),
    ("cp2", r"pNxdN \(prefill/decode pools\)"),
])
def test_bad_pools(text, message):
    with pytest.raises(ValueError, match=message):
        StrategySpec.parse(text)


def test_pools_take_a_mixture_of_experts_with_every_expert_in_each_engine():
    StrategySpec.parse("p1xd1").validate(tiny_config("mixtral"))
    StrategySpec.parse("p1xd1xtp2").validate(tiny_config("mixtral"))
    with pytest.raises(ValueError, match="expert parallel"):  # ep groups span the pools
        StrategySpec.parse("p1xd1xep")


def test_the_hand_off_tier_is_on_by_default(tiny_llama):
    cache = create_config(EngineArgs(model=tiny_llama, strategy="p1xd1")).cache
    assert cache.kv_offloading_size == DEFAULT_HANDOFF_TIER
    sized = create_config(EngineArgs(model=tiny_llama, strategy="p1xd1",
                                     kv_offloading_size=8 << 20)).cache
    assert sized.kv_offloading_size == 8 << 20
    with pytest.raises(ValueError, match="block hashes"):
        create_config(EngineArgs(model=tiny_llama, strategy="p1xd1",
                                 enable_prefix_caching=False))
    with pytest.raises(ValueError, match="backend mp"):
        create_config(EngineArgs(model=tiny_llama, strategy="p1xd1",
                                 distributed_executor_backend="ray"))


def test_each_pool_has_its_own_limits(tiny_llama):
    config = create_config(EngineArgs(model=tiny_llama, strategy="p1xd1", max_num_seqs=16,
                                      prefill_max_num_batched_tokens=4096,
                                      decode_max_num_seqs=64))
    spec, sched = config.parallel.strategy, config.scheduler
    assert [engine_pool(spec, r) for r in (0, 1)] == ["prefill", "decode"]
    prefill, decode = sched.for_pool("prefill"), sched.for_pool("decode")
    assert (prefill.max_num_batched_tokens, prefill.max_num_seqs) == (4096, 16)
    assert (decode.max_num_batched_tokens, decode.max_num_seqs) == (
        sched.max_num_batched_tokens, 64)
    assert sched.for_pool(None) is sched and engine_pool(StrategySpec.parse("dp2"), 1) is None
    with pytest.raises(ValueError, match="has none"):
        create_config(EngineArgs(model=tiny_llama, strategy="dp2", decode_max_num_seqs=64))
    with pytest.raises(ValueError, match="--decode-max-num-seqs must be >= 1"):
        create_config(EngineArgs(model=tiny_llama, strategy="p1xd1", decode_max_num_seqs=0))

"""Plan truth: with default flags, `plan --json` predicts the KV blocks and the weight bytes
per worker that the started engines report, offline at tp1 and tp3 (served at dp2xtp3:
tests/serve/test_plan_truth.py). The tiny models run in float32: in bf16 (what `auto` gives
them on a CPU with bf16 dot products) the load-time timing may widen a tiny weight to fp32,
where an overhead-bound GEMM of that size can time faster, and plan cannot know that."""

from __future__ import annotations

import pytest
from conftest import plan_json, predicted

from parashift import LLM


def _offline(model: str, tp: int, dtype: str) -> tuple[int, list[int]]:
    llm = LLM(model, tensor_parallel_size=tp, dtype=dtype)
    try:
        return llm.engine.num_blocks, llm.engine.weight_bytes
    finally:
        llm.shutdown()


def _check_offline(model: str, tp: int, dtype: str = "auto") -> None:
    blocks, weights = predicted(plan_json(model, f"tp{tp}", "--dtype", dtype))
    engine_blocks, engine_weights = _offline(model, tp, dtype)
    assert engine_blocks == blocks
    # Equal shares on every worker (kv heads shared by several ranks are held by each).
    assert engine_weights == [weights] * tp


@pytest.mark.parametrize("tp", [1, pytest.param(3, marks=pytest.mark.extended)])
def test_tiny_model_offline(tiny_split_by_3, tp):  # tp3: served in serve/test_plan_truth.py
    _check_offline(tiny_split_by_3, tp, "float32")


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, pytest.param(3, marks=pytest.mark.extended)])
def test_smollm2_offline(smollm2_path, tp):
    _check_offline(smollm2_path, tp)


def _check_offline_strategy(model: str, strategy: str, workers: int) -> None:
    blocks, weights = predicted(plan_json(model, strategy, "--dtype", "float32"))
    llm = LLM(model, strategy=strategy, dtype="float32")
    try:
        assert llm.engine.num_blocks == blocks
        # Rank 0 holds the most experts (the remainder goes to the first ranks).
        assert llm.engine.weight_bytes[0] == weights
        assert len(llm.engine.weight_bytes) == workers
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,strategy,workers", [
    ("mixtral", "dp1", 1), ("mixtral", "tp2", 2), ("qwen2_moe", "dp1", 1),
    ("qwen2_moe", "tp2", 2), ("qwen3_moe", "tp2xep", 2)])
def test_moe_models_offline(tiny_model_factory, arch, strategy, workers):
    """Routed experts (split by columns, or whole per rank under ep), the router, Qwen2-MoE's
    gated shared expert and its dense layer: as the engine allocates them."""
    _check_offline_strategy(tiny_model_factory(arch), strategy, workers)


@pytest.mark.parametrize("arch,method", [("llama", "int8"), ("llama", "int4"),
                                         ("qwen2_moe", "int8")])
def test_quantized_weights_offline(tiny_model_factory, arch, method):
    """`-q`: the projections at the format's bytes a value (int4's scales and offsets
    included: exact), the rest in the model's dtype. int8's per-row scales and our int8 GEMM's
    padding to blocks of 16 rows are left out: within 1% on these narrow models in float32
    (their unquantized rest in bf16, as `auto` gives on a bf16 CPU, is half as large)."""
    model = tiny_model_factory(arch)
    blocks, weights = predicted(plan_json(model, "dp1", "-q", method, "--dtype", "float32"))
    assert weights < predicted(plan_json(model, "dp1", "--dtype", "float32"))[1]
    llm = LLM(model, quantization=method, dtype="float32")
    try:
        assert llm.engine.num_blocks == blocks  # the KV budget on CPU is apart from the weights
        (engine,) = llm.engine.weight_bytes
        assert abs(engine - weights) <= (0.01 if method == "int8" else 0) * engine, (engine,
                                                                                 weights)
    finally:
        llm.shutdown()

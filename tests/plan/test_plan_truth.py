"""Plan truth: with default flags, `plan --json` predicts the KV blocks and the weight bytes
per worker that the started engines report, offline at tp1 and tp3 (served at dp2xtp3:
tests/serve/test_plan_truth.py), in the dtype `auto` gives on this CPU (bf16 where it
multiplies bf16 natively) and in float32: whichever GEMM path the load-time timing picks
keeps the same bytes (layers/gemm_paths.py)."""

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


@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("tp", [1, pytest.param(3, marks=pytest.mark.extended)])
def test_tiny_model_offline(tiny_split_by_3, tp, dtype):  # tp3: served in serve/test_plan_truth.py
    _check_offline(tiny_split_by_3, tp, dtype)


def test_a_tied_head_offline(tiny_model_factory):
    """A tied LM head's GEMM keeps its own prepared copy beside the embedding's weight."""
    _check_offline(tiny_model_factory("llama", tie=True), 1)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, pytest.param(3, marks=pytest.mark.extended)])
def test_smollm2_offline(smollm2_path, tp):
    _check_offline(smollm2_path, tp)


def _check_offline_strategy(model: str, strategy: str, workers: int) -> None:
    blocks, weights = predicted(plan_json(model, strategy))
    llm = LLM(model, strategy=strategy)
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
    """`-q`: the projections at the format's bytes a value, with int8's scale per row and
    int4's scales and offsets per group; the rest in the model's dtype."""
    model = tiny_model_factory(arch)
    blocks, weights = predicted(plan_json(model, "dp1", "-q", method))
    assert weights < predicted(plan_json(model, "dp1"))[1]
    llm = LLM(model, quantization=method)
    try:
        assert llm.engine.num_blocks == blocks  # the KV budget on CPU is apart from the weights
        (engine,) = llm.engine.weight_bytes
        assert engine == weights
    finally:
        llm.shutdown()

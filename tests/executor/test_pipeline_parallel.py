"""Pipeline parallel in float32: pp stages in worker processes (real gloo send/recv between
them, up to pp batches in flight) give the same greedy tokens and log-probabilities as pp1,
for Llama and Qwen3, tied and untied, uneven splits, pp2xtp2, and SmolLM2 (30 layers) at pp2,
pp4 and an explicit partition. The prompts mix prefill, chunked prefill (32-token budget),
decode and prefix-cache hits; KV capacity is the smallest stage's and `plan` predicts it."""

from __future__ import annotations

import pytest
from conftest import plan_json

from executor.test_tensor_parallel import assert_same, load_peaks, save_42m_model, worker_children
from parashift import LLM, SamplingParams

pytestmark = pytest.mark.slow

SHARED = list(range(40, 90))  # 50 tokens: three full 16-token blocks to share
PROMPTS = [[5, 17, 99, 3], SHARED, [200, 7] * 6, SHARED + [1, 2, 3], list(range(100, 140)),
           SHARED + [9]]
MAX_TOKENS = 6


def generate(model: str, strategy: str | None = None, **flags):
    llm = LLM(model, dtype="float32", max_model_len=256, kv_cache_memory=flags.pop(
        "kv_cache_memory", 8 << 20), max_num_batched_tokens=32, strategy=strategy, **flags)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                logprobs=5)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [o.outputs[0] for o in outputs], [o.metrics.num_cached_tokens for o in outputs], llm
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch, tie", [("llama", False), ("llama", True), ("qwen3", False),
                                       ("qwen3", True)])
def test_pp2_and_pp3_match_pp1(tiny_model_factory, arch, tie):
    folder = tiny_model_factory(arch, tie=tie, num_hidden_layers=5)  # 3+2 and 2+2+1 layers
    reference, _, _ = generate(folder)
    for pp in (2, 3):
        ours, cached, _ = generate(folder, f"pp{pp}")
        assert_same(ours, reference)
        assert any(cached), "the shared prefix was never hit"
    assert worker_children() == []


def test_pp2xtp2_matches_pp1(tiny_model_factory):
    folder = tiny_model_factory("llama", num_hidden_layers=4)
    reference, _, _ = generate(folder)
    assert_same(generate(folder, "pp2xtp2")[0], reference)


def test_kv_capacity_is_the_smallest_stage_and_plan_predicts_it(tiny_model_factory):
    folder = tiny_model_factory("llama", num_hidden_layers=5)
    doc = plan_json(folder, "pp2", "--pp-layer-partition", "4,1", "--kv-cache-memory", "8MiB",
                    "--dtype", "float32", "--max-model-len", "256")
    stages = doc["memory_per_device"]
    assert [s["layers"] for s in stages] == [4, 1]
    llm = LLM(folder, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20,
              strategy="pp2", pp_layer_partition="4,1")
    try:
        assert llm.engine.num_blocks == doc["kv_capacity"]["blocks"]
        assert llm.engine.num_blocks == min(s["kv_blocks"] for s in stages)
        assert llm.engine.weight_bytes == [s["weights"] for s in stages]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("strategy, partition", [("pp2", None), ("pp4", None),
                                                 ("pp2", "20,10")])
def test_smollm2_stages_match_pp1(smollm2_path, smollm2_reference, strategy, partition):
    ours, _, _ = generate(smollm2_path, strategy, kv_cache_memory=32 << 20,
                          pp_layer_partition=partition)
    assert_same(ours, smollm2_reference)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path):
    return generate(smollm2_path, kv_cache_memory=32 << 20)[0]


def test_bad_partitions_are_refused_before_anything_starts(tiny_llama):
    with pytest.raises(ValueError, match="--pp-layer-partition 1,2 sums to 3, the model has 2"):
        LLM(tiny_llama, strategy="pp2", pp_layer_partition="1,2")
    with pytest.raises(ValueError, match="pp3 needs at least 3 layers, the model has 2"):
        LLM(tiny_llama, strategy="pp3")
    with pytest.raises(ValueError, match="has 1 stage"):
        LLM(tiny_llama, strategy="pp2", pp_layer_partition="2")
    assert worker_children() == []


def test_a_stage_loads_about_half_of_the_model(tmp_path):
    """Each stage reads only its own layers (and the embedding or the LM head)."""
    folder = save_42m_model(str(tmp_path))
    (whole,), _ = load_peaks(folder, strategy="pp1")
    peaks, weights = load_peaks(folder, strategy="pp2")
    assert abs(weights[0] - weights[1]) < 0.05 * sum(weights)  # 4 layers + embedding / head
    for peak in peaks:
        assert 0.35 * whole < peak < 0.65 * whole, (peaks, whole)

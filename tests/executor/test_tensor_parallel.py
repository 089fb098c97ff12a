"""Tensor parallel in float32: tp2 and tp4 worker processes (real gloo groups) give the same
greedy tokens and log-probabilities as tp1, for Llama, Qwen2 and Qwen3, including fewer kv
heads than ranks (replicated kv heads), and for SmolLM2 at tp3 (9 heads, 3 kv heads)."""

from __future__ import annotations

import psutil
import pytest

from parashift import LLM, SamplingParams

pytestmark = pytest.mark.slow

LOGPROB_ATOL = 1e-4
PROMPTS = [[5, 17, 99, 3], list(range(40, 90)), [200, 7] * 6]
MAX_TOKENS = 8


def greedy(model: str, tp: int, kv_cache_memory: int = 8 << 20):
    llm = LLM(model, dtype="float32", max_model_len=256, kv_cache_memory=kv_cache_memory,
              max_num_batched_tokens=32, tensor_parallel_size=tp)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                logprobs=5)
        return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def assert_same(ours, reference) -> None:
    for got, want in zip(ours, reference, strict=True):
        assert got.token_ids == want.token_ids
        for step_got, step_want in zip(got.logprobs, want.logprobs, strict=True):
            for token_id, logprob in step_want.items():
                assert abs(step_got[token_id] - logprob) < LOGPROB_ATOL


def worker_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True)
            if "parashift-worker" in " ".join(p.cmdline())]


@pytest.mark.parametrize("arch, kv_heads", [("llama", 2), ("qwen2", 2), ("qwen3", 2),
                                            ("llama", 1)])
def test_tp2_and_tp4_match_tp1(tiny_model_factory, arch, kv_heads):
    folder = tiny_model_factory(arch, num_key_value_heads=kv_heads)
    reference = greedy(folder, 1)
    for tp in (2, 4):  # tp4 > kv heads: every kv head lives on several ranks
        assert_same(greedy(folder, tp), reference)
    assert worker_children() == []  # shutdown stopped them


def test_smollm2_tp3_matches_tp1(smollm2_path):
    reference = greedy(smollm2_path, 1, 32 << 20)
    assert_same(greedy(smollm2_path, 3, 32 << 20), reference)


def test_bad_tp_sizes_are_refused_before_anything_starts(tiny_llama):
    with pytest.raises(ValueError, match=r"tp3 needs num_attention_heads \(4\) divisible by 3"):
        LLM(tiny_llama, tensor_parallel_size=3)
    assert worker_children() == []


def save_42m_model(folder: str) -> str:
    from conftest import save_tiny_model

    return save_tiny_model(folder, "llama", hidden_size=512, intermediate_size=2048,
                           num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                           vocab_size=8192)  # 42 M parameters: 168 MB in float32


def load_peaks(folder: str, **engine_args) -> tuple[list[int], list[int]]:
    """Peak RSS each worker's model load added (read by the studies' worker extension), and its
    weight bytes (worker processes, even for one worker). The load is run twice and the second
    measured: the first times the GEMM paths for the workers' thread count (layers/gemm_paths.py),
    whose scratch copies would count in its peak."""
    from study_probes import EXTENSION

    from parashift.engine.args import EngineArgs, create_config
    from parashift.engine.placement import engine_placement
    from parashift.executor.multiproc import MultiprocExecutor

    config = create_config(EngineArgs(folder, dtype="float32", max_model_len=256,
                                      worker_extension_cls=EXTENSION, **engine_args))
    for _ in range(2):
        executor = MultiprocExecutor(config, engine_placement(config.parallel.strategy, "cpu", 0))
        try:
            measured = executor.collective_rpc("load_peak_rss_bytes"), executor.weight_bytes()
        finally:
            executor.shutdown()
    return measured


def test_a_tp2_worker_loads_about_half_of_what_tp1_loads(tmp_path):
    """Sharded loading: each worker reads only its slice of the safetensors checkpoint."""
    folder = save_42m_model(str(tmp_path))
    (whole,), _ = load_peaks(folder, tensor_parallel_size=1)
    assert whole > 150e6
    for half in load_peaks(folder, tensor_parallel_size=2)[0]:
        assert 0.35 * whole < half < 0.65 * whole, (half, whole)


def test_an_expert_parallel_rank_reads_only_its_experts(tmp_path):
    """tp2xep: each of the 2 ranks holds 4 of the 8 experts, whole, and reads only their bytes
    (an expert it does not hold is skipped unread); the experts are ~90% of the model."""
    from conftest import save_tiny_model

    folder = save_tiny_model(str(tmp_path), "mixtral", hidden_size=256, intermediate_size=1024,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                             num_local_experts=8, vocab_size=1024)  # 27 M parameters
    (whole,), (whole_weights,) = load_peaks(folder)
    assert whole > 100e6
    peaks, weights = load_peaks(folder, strategy="tp2xep")
    for half, held in zip(peaks, weights, strict=True):
        assert 0.35 * whole < half < 0.65 * whole, (half, whole)
        assert 0.45 * whole_weights < held < 0.6 * whole_weights, (held, whole_weights)

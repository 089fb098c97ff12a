"""The decoder layers as one CPU kernel call each (executor/fused_cpu_layers.py) against the same
layers called one by one: the same kernels in the same order, so greedy tokens and logprobs
agree exactly, through decodes, prefills, chunked prefills mixed with decodes, a q/k/v bias,
a sliding window and MoE layers (the call stops before their experts), with bf16 or int8
weights (`--quantization int8` on our int8 GEMM); and where the fused path is not taken."""

from __future__ import annotations

import pytest
import torch
from kernel_tests.builds import MARCHES, cpu_flags

from parashift.executor.fused_cpu_layers import FusedCpuLayers
from parashift.layers.kernel_dispatch import cpu_ops
from parashift.layers.quantization import own_int8_kernel

pytestmark = pytest.mark.skipif(cpu_ops() is None or not cpu_ops().bf16_attention,
                                reason="the fused layers need a vector bf16 decode attention")

HEAD_64 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=256)


def _generate(folder: str, fused: bool, monkeypatch, quantization: str | None = None,
              cpu_kernels: str = "native", deterministic: bool = False) -> tuple[list, list]:
    """(tokens and logprobs per prompt, the fused calls' (tokens, decodes, prefills))."""
    from parashift import LLM, SamplingParams
    from parashift.layers import gemm_paths

    calls = []
    call = FusedCpuLayers.__call__

    def counted(self, hidden, residual, cos_sin, metadata):
        calls.append((hidden.shape[0], metadata.num_decodes, len(metadata.prefills)))
        return call(self, hidden, residual, cos_sin, metadata)

    with monkeypatch.context() as m:
        # our GEMM path on every weight (timing may choose otherwise)
        m.setattr(gemm_paths.GemmPaths, "choose", lambda self, dtype, *shape, **_: (
            "own-bf16" if dtype == torch.bfloat16 else "linear"))
        m.setattr(FusedCpuLayers, "__call__", counted)
        if not fused:
            m.setattr(FusedCpuLayers, "for_model", classmethod(lambda cls, model: None))
        llm = LLM(folder, dtype="bfloat16", max_model_len=256, enable_prefix_caching=False,
                  max_num_batched_tokens=64, seed=0, quantization=quantization,
                  cpu_kernels=cpu_kernels, deterministic=deterministic)
        try:
            # 64 tokens a step: the long prompts are chunked and share steps with decodes
            prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)]
                       for i, n in enumerate((5, 90, 17, 130, 3))]
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], calls


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "mixtral", "qwen2_moe"])
def test_fused_layers_give_the_layer_by_layer_tokens_and_logprobs(tiny_model_factory, arch,
                                                                   monkeypatch):
    folder = tiny_model_factory(arch, **HEAD_64)
    fused, calls = _generate(folder, True, monkeypatch)
    assert any(decodes and prefills for _, decodes, prefills in calls)  # a mixed step
    assert any(not prefills for _, _, prefills in calls)  # a decode step
    unfused, none = _generate(folder, False, monkeypatch)
    assert not none
    assert fused == unfused


def test_fused_layers_under_deterministic_attend_in_the_layers_order(tiny_model_factory,
                                                                     monkeypatch):
    """--deterministic: the fused call's prefill chunks take the tiled kernel in the decode
    kernel's order, as the layers called one by one do (it had taken the default order)."""
    folder = tiny_model_factory("llama", **HEAD_64)
    fused, calls = _generate(folder, True, monkeypatch, deterministic=True)
    assert any(decodes and prefills for _, decodes, prefills in calls)
    unfused, none = _generate(folder, False, monkeypatch, deterministic=True)
    assert not none
    assert fused == unfused


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe"])
def test_fused_int8_layers_give_the_layer_by_layer_tokens_and_logprobs(tiny_model_factory, arch,
                                                                        monkeypatch):
    if not own_int8_kernel(HEAD_64["hidden_size"]):
        pytest.skip("our int8 GEMM does not run on this CPU (it needs AMX)")
    folder = tiny_model_factory(arch, **HEAD_64)
    fused, calls = _generate(folder, True, monkeypatch, "int8")
    assert any(decodes and prefills for _, decodes, prefills in calls)
    unfused, none = _generate(folder, False, monkeypatch, "int8")
    assert not none
    assert fused == unfused
    assert fused != _generate(folder, True, monkeypatch)[0]  # the weights were int8


def test_fused_decode_steps_built_for_avx2(tiny_model_factory, monkeypatch):
    """The kernels built for Haswell (the FMA GEMM, decode attention on AVX2): decode steps
    fused, steps with prefills layer by layer (their tokens go to SDPA there), same bits."""
    from parashift.layers import kernel_dispatch

    if not MARCHES["haswell"] <= cpu_flags():
        pytest.skip("this CPU cannot run code built for -march=haswell")
    folder = tiny_model_factory("llama", **HEAD_64)
    try:
        fused, calls = _generate(folder, True, monkeypatch, cpu_kernels="haswell")
        assert kernel_dispatch.cpu_ops().bf16_gemm == "fma"
        unfused, _ = _generate(folder, False, monkeypatch, cpu_kernels="haswell")
    finally:
        kernel_dispatch.use_cpu_kernels("native")
    assert calls and all(not prefills for _, _, prefills in calls)
    assert fused == unfused


def test_head_dim_32_stays_layer_by_layer(tiny_model_factory, monkeypatch):
    _, calls = _generate(tiny_model_factory("llama"), True, monkeypatch)
    assert not calls

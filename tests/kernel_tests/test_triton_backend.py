"""The Triton attention backend in the engine (here in Triton's interpreter, fp32) against the
torch backend, on a two-layer model with SmolLM2's attention layout (head_dim 64, 3 query
heads per kv head; the 30 layers of the real model took ~50 s in the interpreter): the same
greedy tokens and the same logprobs within 1e-3, for a short prompt (prefill), a few decode
steps and a second request that hits the first one's cached prefix. The backend is chosen by
the registry: auto is torch on CPU."""

import pytest

from parashift.engine.args import EngineArgs, create_config, resolve_attention_backend
from parashift.engine.llm import LLM
from parashift.types.sampling_params import SamplingParams

PROMPT = ("Paris is the capital of France, Berlin the capital of Germany, Madrid the capital "
          "of Spain and Lisbon the capital of Portugal. The capital of Italy is")


def run(model: str, backend: str) -> list:
    llm = LLM(model, dtype="float32", attention_backend=backend,
              kv_cache_memory=64 * 2**20, max_model_len=256)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    first = llm.generate([PROMPT], params, use_tqdm=False)
    again = llm.generate([PROMPT + " Rome."], params, use_tqdm=False)  # a prefix-cache hit
    return [o.outputs[0] for o in first + again]


def test_the_triton_backend_equals_the_torch_backend(tiny_model_factory):
    model = tiny_model_factory("llama", hidden_size=384, num_attention_heads=6,
                               num_key_value_heads=2, intermediate_size=256)
    want, got = run(model, "torch"), run(model, "triton")
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        for w_step, g_step in zip(w.logprobs, g.logprobs, strict=True):
            assert w_step.keys() == g_step.keys()
            for token in w_step:
                assert abs(w_step[token] - g_step[token]) < 1e-3


def test_the_registry_picks_cpu_kernels_on_cpu_and_refuses_triton_without_a_gpu(
        smollm2_path, monkeypatch):
    def backend(**kwargs):
        return create_config(EngineArgs(model=smollm2_path, device="cpu", **kwargs)
                             ).device.attention_backend

    assert backend() == "cpu"
    assert backend(dtype="float16") == "torch"  # the CPU kernels are float32 and bfloat16
    with pytest.raises(ValueError, match="--attention-backend cpu runs on --device cpu in "
                                         "float32 or bfloat16, not on cpu in float16"):
        backend(attention_backend="cpu", dtype="float16")
    assert backend(attention_backend="triton") == "triton"  # the interpreter is on here
    with pytest.raises(ValueError, match="needs --block-size 16 or more, not 8"):
        backend(attention_backend="triton", block_size=8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--attention-backend triton needs a CUDA device"):
        backend(attention_backend="triton")


def test_auto_is_triton_on_cuda_with_blocks_of_16_or_more():
    assert resolve_attention_backend("auto", "cuda:1", 16) == "triton"
    assert resolve_attention_backend("auto", "cuda", 8) == "torch"  # tl.dot needs 16 rows
    assert resolve_attention_backend("auto", "cpu", 16) == "cpu"
    with pytest.raises(ValueError, match="not on cuda in float32"):
        resolve_attention_backend("cpu", "cuda", 16)
    with pytest.raises(ValueError, match="--attention-backend 'flash' is unknown; known:"):
        resolve_attention_backend("flash", "cpu", 16)

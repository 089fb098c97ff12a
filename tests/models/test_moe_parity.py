"""MoE models against transformers in float32 in one process (ep1): Mixtral, Qwen2-MoE with its
shared expert and a dense layer, Qwen3-MoE. The expert-parallel layouts are in
tests/serve/test_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch
from models.test_parity import assert_matches_reference, mixed_prompts

from parashift import LLM
from parashift.layers.fused_moe import route

MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_model_matches_transformers(tiny_model_factory, arch):
    folder = tiny_model_factory(arch)
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=64, kv_cache_memory=8 << 20)
    assert_matches_reference(llm, folder, mixed_prompts(256), max_tokens=10)


def test_route_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(weights, torch.softmax(logits, -1)[:, :2])
    weights, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(weights.sum(-1), torch.ones(1))


@pytest.mark.parametrize("arch,strategy", [("mixtral", "tp2"), ("qwen2_moe", "tp2"),
                                           ("qwen3_moe", "tp2xep"), ("qwen2_moe", "pp2")])
def test_moe_model_in_one_engine_over_two_ranks_matches_transformers(tiny_model_factory, arch,
                                                                   strategy):
    """tp2: every expert split by columns; tp2xep: whole experts, 3 on one rank and 2 on the
    other, summed by the tp all-reduce; pp2: a sparse stage and a dense one."""
    folder = tiny_model_factory(arch)
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=64, kv_cache_memory=8 << 20,
              strategy=strategy)
    try:
        assert_matches_reference(llm, folder, mixed_prompts(256), max_tokens=8)
    finally:
        llm.shutdown()

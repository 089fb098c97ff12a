"""Qwen3-MoE: Qwen3 attention (q/k norms), sparse blocks without a shared expert."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parashift.distributed.parallel_context import ParallelContext
from parashift.models.llama import LlamaMLP
from parashift.models.moe_block import SparseMoeBlock
from parashift.models.moe_model import MoEModel, is_sparse_layer
from parashift.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(MoEModel, Qwen3ForCausalLM):
    def make_mlp(self, cfg: Any, layer_index: int, dtype: torch.dtype,
                 parallel: ParallelContext) -> nn.Module:
        if not is_sparse_layer(cfg, layer_index):
            return LlamaMLP(cfg, dtype, parallel)
        return SparseMoeBlock(cfg, dtype, parallel, self.expert_dispatcher(parallel),
                              cfg.num_experts, cfg.moe_intermediate_size,
                              bool(cfg.norm_topk_prob))

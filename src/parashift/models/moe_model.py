"""What every MoE model adds to its dense base: one expert dispatcher shared by its sparse
blocks, which the model runner starts each step with (`begin_step`); and the Qwen-MoE rule of
which layers are sparse."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parashift.distributed.expert_dispatch import ExpertDispatcher
from parashift.distributed.parallel_context import ParallelContext
from parashift.models.llama import LlamaMLP
from parashift.models.moe_block import SparseMoeBlock


class MoEModel:
    dispatcher: ExpertDispatcher | None = None

    def expert_dispatcher(self, parallel: ParallelContext) -> ExpertDispatcher:
        if self.dispatcher is None:
            self.dispatcher = ExpertDispatcher(parallel.group("ep"))
        return self.dispatcher


def is_sparse_layer(cfg: Any, layer_index: int) -> bool:
    """Qwen-MoE's rule: layers in `mlp_only_layers` stay dense, and only every
    `decoder_sparse_step`-th layer is sparse."""
    if layer_index in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return cfg.num_experts > 0 and (layer_index + 1) % step == 0


class QwenMoEModel(MoEModel):
    """Qwen2-MoE and Qwen3-MoE: sparse blocks of `num_experts` experts where the rule says,
    renormalised top-k if `norm_topk_prob`, with a gated shared expert if the config has one
    (Qwen2-MoE); dense MLPs elsewhere."""

    def make_mlp(self, cfg: Any, layer_index: int, dtype: torch.dtype,
                 parallel: ParallelContext) -> nn.Module:
        if not is_sparse_layer(cfg, layer_index):
            return LlamaMLP(cfg, dtype, parallel)
        return SparseMoeBlock(cfg, dtype, parallel, self.expert_dispatcher(parallel),
                              cfg.num_experts, cfg.moe_intermediate_size,
                              bool(cfg.norm_topk_prob),
                              getattr(cfg, "shared_expert_intermediate_size", 0) or 0)

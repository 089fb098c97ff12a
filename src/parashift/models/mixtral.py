"""Mixtral: Llama attention, every feed-forward block sparse (top-k of `num_local_experts`,
weights renormalised); the checkpoint names the block `block_sparse_moe`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parashift.distributed.parallel_context import ParallelContext
from parashift.models.llama import LlamaForCausalLM
from parashift.models.moe_block import SparseMoeBlock
from parashift.models.moe_model import MoEModel


class MixtralForCausalLM(MoEModel, LlamaForCausalLM):
    def make_mlp(self, cfg: Any, layer_index: int, dtype: torch.dtype,
                 parallel: ParallelContext) -> nn.Module:
        return SparseMoeBlock(cfg, dtype, parallel, self.expert_dispatcher(parallel),
                              cfg.num_local_experts, cfg.intermediate_size, renormalize=True)

    def _local_name(self, name: str) -> str | None:
        return super()._local_name(name.replace(".block_sparse_moe.", ".mlp."))

"""The sparse feed-forward block of the MoE models: a replicated router, the routed experts
(`FusedMoE`), and Qwen2-MoE's shared expert behind its sigmoid gate."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parashift.distributed.expert_dispatch import ExpertDispatcher
from parashift.distributed.parallel_context import ParallelContext
from parashift.layers.fused_moe import FusedMoE
from parashift.layers.linear import ReplicatedLinear
from parashift.models.llama import LlamaMLP


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, parallel: ParallelContext,
                 dispatcher: ExpertDispatcher, num_experts: int, intermediate_size: int,
                 renormalize: bool, shared_intermediate_size: int = 0):
        super().__init__()
        h = cfg.hidden_size
        self.gate = ReplicatedLinear(h, num_experts, dtype, parallel)
        self.experts = FusedMoE(num_experts, cfg.num_experts_per_tok, h, intermediate_size,
                                renormalize, dtype, parallel, dispatcher)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, dtype, parallel, shared_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(h, 1, dtype, parallel)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden, self.gate)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden))
            out = out + gate * self.shared_expert(hidden)
        return out

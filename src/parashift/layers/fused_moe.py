"""The routed experts of an MoE layer: top-k routing, tokens grouped by expert, one GEMM pair
per expert that has tokens in torch, or on CUDA the Triton fused kernel (two grouped GEMMs
over the slots sorted and aligned by expert, with no host sync).

Sharding, from the rank's shard plan:
- without expert parallel every rank holds every expert, its intermediate columns split over
  tp like a dense MLP (gate/up by columns, down by rows), and the partial sums are all-reduced;
- with expert parallel a rank holds whole experts, its range of `shard.experts`; the
  dispatcher brings every engine's tokens to it and takes the outputs back, and the engine's
  tp ranks (which hold different experts) sum theirs with the same all-reduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parashift.distributed.expert_dispatch import ExpertDispatcher
from parashift.distributed.parallel_context import ParallelContext
from parashift.layers.activation import silu_and_mul
from parashift.layers.kernel_dispatch import on_kernels
from parashift.layers.weights import WeightSource

# checkpoint projection -> (our parameter, block of it): gate and up share w13
EXPERT_PROJECTIONS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1),
                      "up_proj": ("w13", 1), "w2": ("w2", None), "down_proj": ("w2", None)}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, the top k; Mixtral and Qwen3-MoE renormalise the
    k weights to sum to 1 (`norm_topk_prob`), Qwen2-MoE by default does not.
    -> weights [num_tokens, top_k] float32, expert ids [num_tokens, top_k]."""
    probs = F.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, dtype: torch.dtype, parallel: ParallelContext,
                 dispatcher: ExpertDispatcher | None = None):
        super().__init__()
        shard = parallel.shard
        self.tp = parallel.tp
        self.dispatcher = dispatcher or ExpertDispatcher(parallel.group("ep"))
        self.top_k, self.renormalize, self.num_experts = top_k, renormalize, num_experts
        if shard.experts is not None and shard.ep_size > 1:
            self.first_expert, end = shard.experts
            self.tp_rank, columns = 0, intermediate_size
        else:  # every expert, its columns split over tp
            self.first_expert, end = 0, num_experts
            if intermediate_size % shard.tp_size:
                raise ValueError(f"moe intermediate size {intermediate_size} is not divisible "
                                 f"by tp={shard.tp_size}")
            self.tp_rank, columns = shard.tp_rank, intermediate_size // shard.tp_size
        self.num_local_experts = end - self.first_expert
        self.columns, self.hidden_size = columns, hidden_size
        self.intermediate_size = intermediate_size
        # [local experts, 2 * columns, hidden]: gate rows, then up rows
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * columns, hidden_size,
                                            dtype=dtype), requires_grad=False)
        # [local experts, hidden, columns]
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, columns,
                                           dtype=dtype), requires_grad=False)

    def holds(self, expert_id: int) -> bool:
        return 0 <= expert_id - self.first_expert < self.num_local_experts

    def load_expert(self, expert_id: int, projection: str, source: WeightSource) -> str:
        """Copy this rank's slice of one expert's projection; returns our parameter's name."""
        name, block = EXPERT_PROJECTIONS[projection]
        local, cols = expert_id - self.first_expert, self.columns
        if name == "w2":  # [hidden, intermediate]: our columns
            source.expect(self.hidden_size, self.intermediate_size)
            self.w2.data[local].copy_(source.narrow(1, self.tp_rank * cols, cols))
        else:  # [intermediate, hidden]: our rows, into the gate or the up block
            source.expect(self.intermediate_size, self.hidden_size)
            self.w13.data[local, block * cols : (block + 1) * cols].copy_(
                source.narrow(0, self.tp_rank * cols, cols))
        return name

    def forward(self, hidden: torch.Tensor, router: nn.Module) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden], summed over the tp group. `router`
        maps hidden states to [tokens, num_experts] logits (replicated on every rank)."""
        num_tokens = hidden.shape[0]
        tokens = self.dispatcher.dispatch(hidden)  # every engine's tokens under ep
        weights, ids = route(router(tokens), self.top_k, self.renormalize)
        self.dispatcher.count_routed(ids, self.num_experts)
        if self.dispatcher.is_active:  # padding rows route nowhere
            valid = self.dispatcher.valid_rows(tokens.device)
            ids = ids.masked_fill(~valid[:, None], -1)
        out = self._experts(tokens, weights, ids)
        out = self.dispatcher.combine(out, num_tokens)
        return self.tp.all_reduce(out)

    def _experts(self, tokens: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                 ) -> torch.Tensor:
        """The local experts' weighted outputs for `tokens` ([rows, hidden]); rows routed
        only to other ranks' experts stay zero."""
        if on_kernels(tokens):
            from parashift.kernels.fused_moe import fused_moe

            local = ids - self.first_expert
            elsewhere = (ids < 0) | (local >= self.num_local_experts) | (local < 0)
            return fused_moe(tokens, self.w13, self.w2, weights,
                             local.masked_fill(elsewhere, self.num_local_experts))
        out = torch.zeros_like(tokens)
        local = ids.flatten() - self.first_expert  # [rows * top_k]
        held = (local >= 0) & (local < self.num_local_experts)
        slots = held.nonzero().squeeze(1)
        if slots.numel() == 0:
            return out
        local = local[slots]
        order = local.argsort(stable=True)
        slots = slots[order]  # (token, choice) slots grouped by expert
        counts = torch.bincount(local, minlength=self.num_local_experts).tolist()
        rows = slots // self.top_k
        scale = weights.flatten()[slots].to(tokens.dtype)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            index = rows[start : start + count]
            x = tokens.index_select(0, index)
            y = silu_and_mul(x @ self.w13[expert].t()) @ self.w2[expert].t()
            out.index_add_(0, index, y * scale[start : start + count, None])
            start += count
        return out

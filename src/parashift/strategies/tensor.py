"""Tensor parallel: each engine's model split over tp worker processes -- attention heads and
MLP columns (column-parallel in, row-parallel out, an all-reduce after each) and vocabulary
rows (the embedding all-reduces, the LM head gathers on tp rank 0)."""

from __future__ import annotations

import dataclasses
from typing import Any

from parashift.strategies.base import Strategy
from parashift.strategies.layout import (
    DeviceCost,
    GroupSpec,
    MeshAxis,
    MeshPoint,
    ProcessPlan,
    ShardPlan,
    Traffic,
)


class TensorParallel(Strategy):
    name, axis = "tp", "tensor"

    def check_model(self, hf_config: Any) -> list[str]:
        tp, errors = self.size, []
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if heads % tp:
            errors.append(f"tp{tp} needs num_attention_heads ({heads}) divisible by {tp}")
        if kv_heads % tp and tp % kv_heads:
            errors.append(f"tp{tp} needs num_key_value_heads ({kv_heads}) and {tp} to divide "
                          "one another")
        inter = getattr(hf_config, "intermediate_size", None)
        if inter is not None and inter % tp:
            errors.append(f"tp{tp} needs intermediate_size ({inter}) divisible by {tp}")
        return errors

    def mesh(self) -> MeshAxis:
        return MeshAxis("tp", self.size, spans_engines=False)

    def groups(self) -> list[GroupSpec]:
        return [GroupSpec("tp", ("tp",))]

    def shard(self, plan: ShardPlan, at: MeshPoint, hf_config: Any) -> ShardPlan:
        return dataclasses.replace(plan, tp_rank=at.coords["tp"], tp_size=self.size)

    def cost(self, cost: DeviceCost, plan: ShardPlan) -> DeviceCost:
        tp = self.size
        if tp == 1:
            return cost
        cost = dataclasses.replace(
            cost, num_heads=cost.num_heads // tp,
            num_kv_heads=max(1, cost.num_kv_heads // tp),  # fewer kv heads than ranks: shared
            intermediate_size=cost.intermediate_size // tp,
            moe_intermediate_size=cost.moe_intermediate_size // tp,
            shared_intermediate_size=cost.shared_intermediate_size // tp,
            vocab_rows=-(-cost.vocab_rows // tp),  # padded: equal rows on every rank
            mla_attention_params=cost.mla_attention_params // tp,
            traffic=dict(cost.traffic))
        # o_proj and down_proj of every layer, and the embedding: all-reduces of the hidden
        # states; the LM head gathers each sampled row's vocabulary slices on tp rank 0.
        count = 2 * cost.layers + (1 if cost.has_embedding else 0)
        cost.traffic["tp"] = Traffic(tp, count, count * cost.hidden_size, "all-reduce",
                                     (tp - 1) * cost.vocab_rows if plan.has_lm_head else 0)
        return cost

    def processes(self, plan: ProcessPlan) -> ProcessPlan:
        return dataclasses.replace(plan, workers_per_engine=plan.workers_per_engine * self.size)

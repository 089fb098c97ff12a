"""Expert parallel (a flag): the routed experts of an MoE model spread over the dp x tp ranks
instead of being replicated, tokens dispatched to their experts' ranks and combined back, and
every engine in lockstep. It plans and validates today; it runs once the MoE issue lands."""

from __future__ import annotations

import dataclasses
from typing import Any

from parashift.strategies.base import Strategy
from parashift.strategies.layout import (
    DeviceCost,
    GroupSpec,
    MeshPoint,
    ProcessPlan,
    ShardPlan,
    Traffic,
)


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """[first, end) of `ep_rank`'s experts: E // ep each, the first E % ep ranks one more."""
    base, extra = divmod(num_experts, ep_size)
    first = ep_rank * base + min(ep_rank, extra)
    return first, first + base + (1 if ep_rank < extra else 0)


def num_experts_of(hf_config: Any) -> int:
    return (getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts",
                                                                     None) or 0)


class ExpertParallel(Strategy):
    name, axis, is_flag, available = "ep", "expert", True, False

    def check_model(self, hf_config: Any) -> list[str]:
        if not num_experts_of(hf_config):
            return ["ep: the model has no experts (expert parallel needs an MoE model)"]
        return []

    def mesh(self) -> None:
        return None  # no dimension of its own: it spans the dp x tp ranks

    def groups(self) -> list[GroupSpec]:
        return [GroupSpec("ep", ("dp", "tp"))]

    def shard(self, plan: ShardPlan, at: MeshPoint, hf_config: Any) -> ShardPlan:
        tp = at.sizes.get("tp", 1)
        size = at.sizes.get("dp", 1) * tp
        rank = at.coords.get("dp", 0) * tp + at.coords.get("tp", 0)
        return dataclasses.replace(plan, ep_rank=rank, ep_size=size,
                                   experts=expert_range(num_experts_of(hf_config), size, rank))

    def cost(self, cost: DeviceCost, plan: ShardPlan) -> DeviceCost:
        if plan.experts is None or not cost.moe_layers:
            return cost
        first, end = plan.experts
        # A rank holds whole experts: tp no longer splits their columns.
        cost = dataclasses.replace(cost, experts_held=end - first,
                                   moe_intermediate_size=cost.moe_intermediate_size
                                   * plan.tp_size, traffic=dict(cost.traffic))
        if plan.ep_size > 1:  # dispatch and combine per MoE layer, top-k copies per token
            top_k = cost.num_experts_per_tok or 1
            share = (plan.ep_size - 1) / plan.ep_size
            cost.traffic["ep"] = Traffic(plan.ep_size, 2 * cost.moe_layers,
                                         2 * cost.moe_layers * top_k * cost.hidden_size * share,
                                         "all-to-all")
        return cost

    def processes(self, plan: ProcessPlan) -> ProcessPlan:
        return dataclasses.replace(plan, lockstep=True,
                                   coordinator=plan.coordinator or plan.num_engines > 1)

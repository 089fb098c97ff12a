"""Expert parallel (a flag): the routed experts of an MoE model spread over the dp x tp ranks
instead of being replicated. Attention stays data-parallel; each MoE layer sends every
engine's tokens to the ranks holding their experts and sums the outputs back
(distributed/expert_dispatch.py), so with dp > 1 every engine runs every step: the
coordinator's waves keep them in lockstep.

Remainder rule: E experts over R = dp x tp ranks give each rank E // R, and the first E % R
ranks one more (rank = dp * tp + tp coordinate)."""

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
    name, axis, is_flag = "ep", "expert", True

    def check_model(self, hf_config: Any) -> list[str]:
        if not num_experts_of(hf_config):
            return ["ep: the model has no experts (expert parallel needs an MoE model)"]
        return []

    def check_layout(self, sizes: dict[str, int], hf_config: Any) -> list[str]:
        ranks = sizes.get("dp", 1) * sizes.get("tp", 1)
        experts = num_experts_of(hf_config)
        errors = []
        if experts < ranks:
            errors.append(f"ep: {ranks} dp x tp ranks need at least {ranks} experts, the "
                          f"model has {experts}")
        if sizes.get("pp", 1) > 1:
            errors.append("ep does not combine with pp yet; use dp and tp with ep")
        return errors

    def mesh(self) -> None:
        return None  # no dimension of its own: it spans the dp x tp ranks

    def groups(self) -> list[GroupSpec]:
        # Dispatch and combine run among the ranks of one tp coordinate, one per engine; the
        # engine's tp group then sums what its ranks' different experts gave.
        return [GroupSpec("ep", ("dp",))]

    def shard(self, plan: ShardPlan, at: MeshPoint, hf_config: Any) -> ShardPlan:
        tp = at.sizes.get("tp", 1)
        size = at.sizes.get("dp", 1) * tp
        rank = at.coords.get("dp", 0) * tp + at.coords.get("tp", 0)
        return dataclasses.replace(plan, ep_rank=rank, ep_size=size,
                                   experts=expert_range(num_experts_of(hf_config), size, rank))

    def cost(self, cost: DeviceCost, plan: ShardPlan) -> DeviceCost:
        if plan.experts is None or not cost.moe_layers or plan.ep_size == 1:
            return cost
        first, end = plan.experts
        # A rank holds whole experts: tp no longer splits their columns.
        cost = dataclasses.replace(cost, experts_held=end - first,
                                   moe_intermediate_size=cost.moe_intermediate_size
                                   * plan.tp_size, traffic=dict(cost.traffic))
        engines = plan.ep_size // plan.tp_size
        if engines > 1:  # per MoE layer: all-gather every engine's tokens, reduce-scatter back
            cost.traffic["ep"] = Traffic(engines, 2 * cost.moe_layers,
                                         2 * cost.moe_layers * cost.hidden_size * (engines - 1),
                                         "all-gather+reduce-scatter")
        return cost

    def processes(self, plan: ProcessPlan) -> ProcessPlan:
        if plan.num_engines == 1:
            return plan
        return dataclasses.replace(plan, lockstep=True, coordinator=True)

"""Pipeline parallel: the decoder layers split into pp stages (evenly, the extra layers on the
first stages); the first stage holds the embedding, the last the final norm and LM head.
It plans and validates today; the stages run once the pipeline issue lands."""

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


def stage_layers(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """[first, end) of `stage`'s layers: as even as possible, the extra ones first."""
    base, extra = divmod(num_layers, pp)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)


class PipelineParallel(Strategy):
    name, axis, available = "pp", "pipeline", False

    def check_model(self, hf_config: Any) -> list[str]:
        layers = hf_config.num_hidden_layers
        if self.size > layers:
            return [f"pp{self.size} needs at least {self.size} layers, the model has {layers}"]
        return []

    def mesh(self) -> MeshAxis:
        return MeshAxis("pp", self.size, spans_engines=False)

    def groups(self) -> list[GroupSpec]:
        return [GroupSpec("pp", ("pp",))]

    def shard(self, plan: ShardPlan, at: MeshPoint, hf_config: Any) -> ShardPlan:
        stage = at.coords["pp"]
        return dataclasses.replace(
            plan, layers=stage_layers(hf_config.num_hidden_layers, self.size, stage),
            has_embedding=stage == 0, has_lm_head=stage == self.size - 1)

    def cost(self, cost: DeviceCost, plan: ShardPlan) -> DeviceCost:
        if self.size == 1 or plan.layers is None:
            return cost
        first, end = plan.layers
        moe = (sum(1 for i in range(first, end) if i >= cost.first_dense_layers)
               if cost.moe_layers else 0)
        # A tied LM head on another stage than the embedding needs its own copy.
        lm_head = plan.has_lm_head and (cost.has_lm_head or not plan.has_embedding)
        cost = dataclasses.replace(cost, layers=end - first, moe_layers=moe,
                                   has_embedding=plan.has_embedding, has_lm_head=lm_head,
                                   has_final_norm=plan.has_lm_head, traffic=dict(cost.traffic))
        if not plan.has_lm_head:  # hidden states on to the next stage
            cost.traffic["pp"] = Traffic(self.size, 1, cost.hidden_size, "send/recv")
        return cost

    def processes(self, plan: ProcessPlan) -> ProcessPlan:
        return dataclasses.replace(plan, workers_per_engine=plan.workers_per_engine * self.size)

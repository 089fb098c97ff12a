"""Data parallel: independent engine replicas, each with its own scheduler and KV cache."""

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
)


class DataParallel(Strategy):
    name, axis = "dp", "data"

    def mesh(self) -> MeshAxis:
        return MeshAxis("dp", self.size, spans_engines=True)

    def groups(self) -> list[GroupSpec]:
        # None: replicas share no tensors. What crosses engines goes over ZMQ (requests,
        # the coordinator's stats and waves); ep declares its own group over the dp ranks.
        return []

    def shard(self, plan: ShardPlan, at: MeshPoint, hf_config: Any) -> ShardPlan:
        return plan  # every replica holds the whole model

    def cost(self, cost: DeviceCost, plan: ShardPlan) -> DeviceCost:
        return cost  # replicas exchange no tensors

    def processes(self, plan: ProcessPlan) -> ProcessPlan:
        return dataclasses.replace(plan, num_engines=plan.num_engines * self.size,
                                   coordinator=plan.coordinator or self.size > 1)

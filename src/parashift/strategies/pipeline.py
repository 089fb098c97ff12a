"""Pipeline parallel: the decoder layers split into pp stages (evenly, the extra layers on the
first stages, or as `--pp-layer-partition` says); the first stage holds the embedding, the
last the final norm and LM head (its own copy of a tied embedding). Each stage is a set of tp
workers; activations go stage to stage over the pp group, and the engine keeps up to pp
batches in flight so that every stage has work."""

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


def stage_layers(num_layers: int, pp: int, stage: int,
                 partition: tuple[int, ...] | None = None) -> tuple[int, int]:
    """[first, end) of `stage`'s layers: per `partition` (layers per stage) when given, else
    as even as possible, the extra ones first."""
    if partition is not None and len(partition) == pp:  # (check_model names a wrong length)
        first = sum(partition[:stage])
        return first, first + partition[stage]
    base, extra = divmod(num_layers, pp)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)


def parse_partition(text: str) -> tuple[int, ...]:
    """'10,10,10' -> (10, 10, 10)."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--pp-layer-partition {text!r}: give the layers of each stage joined "
                         "by commas, like 10,10,10") from None
    return sizes


class PipelineParallel(Strategy):
    name, axis = "pp", "pipeline"

    def __init__(self, size: int = 1, partition: list[int] | tuple[int, ...] | None = None):
        super().__init__(size)
        self.partition = tuple(partition) if partition is not None else None

    def options(self) -> dict[str, list[int]]:
        return {"partition": list(self.partition)} if self.partition is not None else {}

    def check_model(self, hf_config: Any) -> list[str]:
        layers = hf_config.num_hidden_layers
        if self.partition is not None:
            text = ",".join(map(str, self.partition))
            if len(self.partition) != self.size:
                return [f"--pp-layer-partition {text} has {len(self.partition)} stage(s), the "
                        f"strategy has pp{self.size}"]
            if min(self.partition) < 1:
                return [f"--pp-layer-partition {text}: every stage needs at least one layer"]
            if sum(self.partition) != layers:
                return [f"--pp-layer-partition {text} sums to {sum(self.partition)}, the model "
                        f"has {layers} layers"]
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
            plan, layers=stage_layers(hf_config.num_hidden_layers, self.size, stage,
                                      self.partition),
            has_embedding=stage == 0, has_lm_head=stage == self.size - 1)

    def cost(self, cost: DeviceCost, plan: ShardPlan) -> DeviceCost:
        if self.size == 1 or plan.layers is None:
            return cost
        first, end = plan.layers
        moe = (sum(1 for i in range(first, end) if i not in cost.dense_layer_ids)
               if cost.moe_layers else 0)
        # A tied LM head on another stage than the embedding needs its own copy.
        lm_head = plan.has_lm_head and (cost.has_lm_head or not plan.has_embedding)
        cost = dataclasses.replace(cost, layers=end - first, moe_layers=moe,
                                   has_embedding=plan.has_embedding, has_lm_head=lm_head,
                                   has_final_norm=plan.has_lm_head, traffic=dict(cost.traffic))
        if not plan.has_lm_head:  # hidden states and residual on to the next stage
            cost.traffic["pp"] = Traffic(self.size, 1, 2 * cost.hidden_size, "send/recv")
        return cost

    def processes(self, plan: ProcessPlan) -> ProcessPlan:
        return dataclasses.replace(
            plan, workers_per_engine=plan.workers_per_engine * self.size,
            max_batches_in_flight=plan.max_batches_in_flight * self.size)

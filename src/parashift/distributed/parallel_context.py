"""What a model's parallel layers are built with, passed to them explicitly: this rank's shard
plan (from the strategy's `shard` hook) and one communicator per named process group (from its
`groups` hook). A group this rank is not split over answers as a size-1 identity."""

from __future__ import annotations

from dataclasses import dataclass, field

from parashift.distributed.communicator import GroupCommunicator
from parashift.strategies.layout import ShardPlan


@dataclass(frozen=True)
class ParallelContext:
    shard: ShardPlan = field(default_factory=ShardPlan)
    groups: dict[str, GroupCommunicator] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.shard.tp_size != self.tp.world_size:  # a split with nobody to sum it with
            raise ValueError(f"the shard plan splits over tp{self.shard.tp_size} but the tp "
                             f"group has {self.tp.world_size} rank(s)")

    def group(self, name: str) -> GroupCommunicator:
        return self.groups.get(name) or GroupCommunicator()

    @property
    def tp(self) -> GroupCommunicator:
        return self.group("tp")

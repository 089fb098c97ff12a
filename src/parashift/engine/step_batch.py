"""The batch a scheduler step is making: what is left of its token budget, and what it holds
so far (engine/scheduler.py fills it; its SchedulerOutput is the step's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from parashift.engine.request import Request
from parashift.types.outputs import CachedRequestData, NewRequestData


@dataclass
class StepBatch:
    """The batch being made: what is left of the token budget, and what it holds."""

    budget: int
    stop_at: int  # what is left of the budget when the batch is full
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    pending_grammar: bool = False  # a constrained row samples after a token in flight

    @property
    def has_room(self) -> bool:
        return self.budget > self.stop_at

    def add(self, req: Request, num_new: int) -> None:
        self.num_scheduled[req.request_id] = num_new
        self.budget -= num_new

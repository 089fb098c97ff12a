"""An API server's view of each engine rank, one state machine (the rank's side of
docs/architecture.md "Request states"):

  STARTING --EngineReady--> SERVING --EngineDead--> DEAD --a new incarnation's EngineReady-->
  SERVING
  SERVING or DEAD --RankDraining--> DRAINING --RankRemoved--> ABSENT --EngineReady--> SERVING

STARTING: launched, not ready yet (routed nothing). SERVING: routed to. DEAD: its requests in
flight failed and it is routed nothing until the launcher restarts it. With elastic data
parallel (runtime/scale.py): DRAINING, routed nothing while what it holds finishes or moves;
ABSENT, outside the deployment's current size (a rank up to --data-parallel-size-max that a
scale-up may start, or one a scale-down removed)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from parashift.wire import protocol as p


class RankStatus(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DEAD = "dead"
    DRAINING = "draining"
    ABSENT = "absent"


@dataclass
class Rank:
    status: RankStatus = RankStatus.STARTING
    ready: p.EngineReady | None = None  # its latest incarnation's
    down_reason: str = ""


class EngineRanks:
    def __init__(self, num_engines: int, size: int | None = None):
        """`num_engines` ranks, of which the first `size` (all by default) are launched."""
        size = num_engines if size is None else size
        self.ranks = {r: Rank(RankStatus.STARTING if r < size else RankStatus.ABSENT)
                      for r in range(num_engines)}

    @property
    def size(self) -> int:
        """The ranks in the deployment (all but the absent ones)."""
        return sum(rank.status != RankStatus.ABSENT for rank in self.ranks.values())

    def serving(self) -> list[int]:
        return [r for r, rank in sorted(self.ranks.items())
                if rank.status == RankStatus.SERVING]

    def ever_ready(self) -> dict[int, p.EngineReady]:
        """Each rank that has been ready, its latest EngineReady (a dead one's too)."""
        return {r: rank.ready for r, rank in self.ranks.items() if rank.ready is not None}

    def dead(self) -> dict[int, str]:
        return {r: rank.down_reason for r, rank in self.ranks.items()
                if rank.status == RankStatus.DEAD}

    def starting(self) -> list[int]:
        return [r for r, rank in sorted(self.ranks.items())
                if rank.status == RankStatus.STARTING]

    def states(self) -> dict[str, str]:
        """Every rank's state by name, as /health lists them: {"dp0": "serving", ...}; the
        absent ones are not part of the deployment."""
        return {f"dp{r}": rank.status.value for r, rank in sorted(self.ranks.items())
                if rank.status != RankStatus.ABSENT}

    def status(self, rank: int) -> RankStatus | None:
        state = self.ranks.get(rank)
        return None if state is None else state.status

    def is_dead(self, rank: int) -> bool:
        state = self.ranks.get(rank)
        return state is not None and state.status == RankStatus.DEAD

    # --- the transitions (a rank outside the launch changes nothing: None) --------------------
    def on_ready(self, msg: p.EngineReady) -> RankStatus | None:
        """A first start or a restarted incarnation serves; returns the state it left."""
        rank = self.ranks.get(msg.rank)
        if rank is None:
            return None
        before = rank.status
        rank.status, rank.ready, rank.down_reason = RankStatus.SERVING, msg, ""
        return before

    def on_dead(self, rank: int, reason: str) -> None:
        state = self.ranks.get(rank)
        if state is not None and state.status not in (RankStatus.ABSENT, RankStatus.DRAINING):
            state.status, state.down_reason = RankStatus.DEAD, reason

    def on_draining(self, rank: int) -> bool:
        """A scale-down leaves `rank` out; False if it is not in the deployment."""
        state = self.ranks.get(rank)
        if state is None or state.status == RankStatus.ABSENT:
            return False
        state.status = RankStatus.DRAINING
        return True

    def on_removed(self, rank: int) -> None:
        state = self.ranks.get(rank)
        if state is not None:
            state.status, state.ready, state.down_reason = RankStatus.ABSENT, None, ""

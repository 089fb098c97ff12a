"""Elastic data parallel, the launcher's half (POST /scale reaches it from an API server):
one scale at a time, each a small state machine the launcher's loop advances without waiting.

  up:   start the new ranks (fresh processes, each with a fresh handshake token; over CURVE its
        rank key, minted with the launch's) -> each Ready, and each API server includes a rank
        at its EngineReady -> answer with the new size. A new rank that dies or never becomes
        ready fails the scale: the new ranks stop and the size stays.
  down: the leaving ranks (the highest) drain: the API servers route nothing more there and
        move the requests that have not started -> once the coordinator's load shows them
        empty, or after --drain-timeout, they are removed (what is left moves, or ends with an
        error naming the drain) -> once every API server has said so (or REMOVE_WAIT_S
        passed), their processes stop -> answer.

The ranks a launch may run are fixed at launch (--data-parallel-size-max, the coordinator's,
the API servers' and the handshake's tables); the size moves within them. Nothing that runs is
restarted. Scales asked while one runs wait their turn, in order. On several nodes the
head's scale-up starts ranks on its own node, and a `--headless` node that joins with the
ranks from the current size grows the deployment; a scale-down stops a node's ranks there
(and the node, once it has none); on Ray, placement groups come and go (runtime/ray_engines.py).
Prefill/decode pools scale their decode pool (the ranks at the top); expert-parallel lockstep
groups do not scale yet."""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from parashift.wire import protocol as p

logger = logging.getLogger(__name__)

DRAIN_SETTLE_S = 0.5  # a load vector this long after the drain began shows what reached a rank
REMOVE_WAIT_S = 5.0  # for the API servers' RankRemovedSeen (one that is gone never says it)


class Phase(enum.Enum):
    STARTING = "starting"  # up: the new ranks load
    DRAINING = "draining"  # down: the leaving ranks finish or hand back their requests
    REMOVING = "removing"  # down: the API servers let the ranks go; then they stop


@dataclass
class Scale:
    asker: tuple[int, int]  # (API server index, call id): where the answer goes
    target: int
    phase: Phase
    ranks: list[int]  # the ranks it starts, or those that leave
    began: float = field(default_factory=time.monotonic)
    removing_since: float = 0.0
    seen: set[tuple[int, int]] = field(default_factory=set)  # (API server, rank) let go


@dataclass(frozen=True)
class ScaleLimits:
    capacity: int  # --data-parallel-size-max: the ranks this launch can hold
    startup_timeout: float
    drain_timeout: float
    refusal: str = ""  # why this launch cannot scale at all ("" when it can)
    minimum: int = 1  # the fewest ranks it keeps
    minimum_why: str = "a deployment keeps at least 1"


class Scaler:
    def __init__(self, limits: ScaleLimits, size: int, room: Callable[[int], str]):
        """`room(n)`: why n more ranks would not fit where they would run ("" if they fit;
        LocalEngines.room, RayEngines.room)."""
        self.limits = limits
        self.size = size
        self.room = room
        self.job: Scale | None = None

    def refuse(self, msg: p.ScaleRequest) -> p.ScaleResult | None:
        """The answer to a scale that cannot start (or needs nothing), else None; asked when
        no other scale runs (the launcher queues them)."""
        def no(status: int, error: str) -> p.ScaleResult:
            return p.ScaleResult(msg.call_id, self.size, error, status)

        if self.limits.refusal:
            return no(400, self.limits.refusal)
        if msg.size < self.limits.minimum:
            return no(400, f"data_parallel_size {msg.size}: {self.limits.minimum_why}")
        if msg.size > self.limits.capacity:
            return no(400, f"data_parallel_size {msg.size} is beyond --data-parallel-size-max "
                           f"{self.limits.capacity}: the most ranks this launch can hold "
                           "(start it with a larger one)")
        if msg.size == self.size:
            return p.ScaleResult(msg.call_id, self.size)  # nothing to change
        if msg.size > self.size and (no_room := self.room(msg.size - self.size)):
            return no(409, no_room)
        return None

    def begin(self, msg: p.ScaleRequest) -> Scale:
        up = msg.size > self.size
        ranks = (list(range(self.size, msg.size)) if up
                 else list(range(msg.size, self.size)))
        self.job = Scale((msg.index, msg.call_id), msg.size,
                         Phase.STARTING if up else Phase.DRAINING, ranks)
        logger.info("scaling data parallel from %d to %d: %s dp%s", self.size, msg.size,
                    "starting" if up else "draining", ",".join(map(str, ranks)))
        return self.job

    def overdue(self) -> bool:
        job = self.job
        limit = (self.limits.startup_timeout if job.phase == Phase.STARTING
                 else self.limits.drain_timeout)
        return time.monotonic() - job.began > limit

    def drained(self, loads: dict[int, tuple[float, p.EngineLoad]]) -> bool:
        """Every leaving rank empty in a load vector heard well after the drain began."""
        job = self.job
        settled = job.began + DRAIN_SETTLE_S
        for rank in job.ranks:
            heard = loads.get(rank)
            if heard is None or heard[0] < settled:
                return False
            stats = heard[1].stats
            if stats.num_waiting or stats.num_running:
                return False
        return True

    def removing(self) -> None:
        self.job.phase, self.job.removing_since = Phase.REMOVING, time.monotonic()

    def removed(self, num_api_servers: int) -> bool:
        """Every API server let every leaving rank go, or they had REMOVE_WAIT_S to."""
        job = self.job
        return (len(job.seen) >= num_api_servers * len(job.ranks)
                or time.monotonic() - job.removing_since > REMOVE_WAIT_S)

    def finish(self, error: str = "", status: int = 200) -> tuple[int, p.ScaleResult]:
        """The job's end: (the API server to answer, the answer)."""
        job, self.job = self.job, None
        if not error:
            self.size = job.target
            logger.info("data parallel size is %d now (%.1f s)", self.size,
                        time.monotonic() - job.began)
        else:
            logger.error("scaling to %d failed: %s", job.target, error)
        return job.asker[0], p.ScaleResult(job.asker[1], self.size, error, status)


def memory_room(rank_bytes: Callable[[], int], free_bytes: Callable[[], int]
                ) -> Callable[[int], str]:
    """Room for n more ranks on this machine: `rank_bytes()`, what a running rank holds
    (measured), against `free_bytes()`, what the machine has available."""
    def room(n: int) -> str:
        held, free = rank_bytes(), free_bytes()
        if n * held <= free:
            return ""
        return (f"{n} more rank(s) need about {n * held / 2**30:.1f} GiB (a running rank "
                f"holds {held / 2**30:.1f} GiB); the machine has {free / 2**30:.1f} GiB "
                "available")
    return room


def free_memory_bytes() -> int:
    """MemAvailable (Linux); 0 where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss_bytes(pid: int) -> int:
    """The resident memory of a process and its descendants (Linux /proc); 0 if it is gone."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f
                               if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    pending.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total

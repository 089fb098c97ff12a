"""What every set of engine ranks a launcher runs shares, local processes or Ray actors: how
a death is reported (EngineDeath), and when a dead rank starts again (RestartPolicy)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FIRST_RESTART_DELAY_S = 1.0  # doubled for each quick death in a row, up to the maximum
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0  # a rank that lived this long starts again from the first delay


@dataclass
class EngineDeath:
    rank: int
    pid: int  # the dead incarnation
    reason: str


class RestartPolicy:
    """When a dead rank starts again (with restart on): after 1 s, doubling for each quick
    death in a row up to 30 s; a rank that lived a minute starts from 1 s again. The engine
    sets (local processes, Ray actors) tell it when a rank starts and dies, and start the
    ranks it says are due. `clock`: seconds, monotonic (tests pass their own)."""

    def __init__(self, restart: bool, clock: Callable[[], float] = time.monotonic):
        self.restart = restart
        self.clock = clock
        self.started_at: dict[int, float] = {}
        self.delay: dict[int, float] = {}  # each rank's last delay
        self.restart_at: dict[int, float] = {}  # dead ranks waiting for their restart

    def started(self, rank: int) -> None:
        self.started_at[rank] = self.clock()

    def died(self, rank: int) -> None:
        if not self.restart:
            return
        lived = self.clock() - self.started_at.get(rank, 0.0)
        previous = self.delay.get(rank)
        delay = (FIRST_RESTART_DELAY_S if previous is None or lived > STABLE_AFTER_S
                 else min(MAX_RESTART_DELAY_S, 2 * previous))
        self.delay[rank] = delay
        self.restart_at[rank] = self.clock() + delay
        logger.info("restarting engine dp%d in %.0f s", rank, delay)

    def forget(self, rank: int) -> None:
        """The rank left the deployment (a scale-down): no restart is due for it."""
        for table in (self.started_at, self.delay, self.restart_at):
            table.pop(rank, None)

    def due(self) -> list[int]:
        """The dead ranks whose restart time has come (each returned once)."""
        now = self.clock()
        ranks = [rank for rank, when in self.restart_at.items() if when <= now]
        for rank in ranks:
            del self.restart_at[rank]
            logger.info("starting engine dp%d again", rank)
        return ranks

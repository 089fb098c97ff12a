"""What every set of engine ranks a launcher runs shares, local processes or Ray actors: how
a death is reported, and when a dead rank starts again."""

from __future__ import annotations

import logging
import time
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
    death in a row up to 30 s; a rank that lived a minute starts from 1 s again. Subclasses
    provide `_spawn(rank)` and call `_spawned` / `_schedule_restart`."""

    def __init__(self, restart: bool):
        self.restart = restart
        self.started_at: dict[int, float] = {}
        self.restart_delay: dict[int, float] = {}
        self.restart_at: dict[int, float] = {}  # dead ranks waiting for their restart

    def _spawn(self, rank: int) -> None:
        raise NotImplementedError

    def _spawned(self, rank: int) -> None:
        self.started_at[rank] = time.monotonic()

    def _schedule_restart(self, rank: int) -> None:
        if not self.restart:
            return
        lived = time.monotonic() - self.started_at.get(rank, 0.0)
        previous = self.restart_delay.get(rank)
        delay = (FIRST_RESTART_DELAY_S if previous is None or lived > STABLE_AFTER_S
                 else min(MAX_RESTART_DELAY_S, 2 * previous))
        self.restart_delay[rank] = delay
        self.restart_at[rank] = time.monotonic() + delay
        logger.info("restarting engine dp%d in %.0f s", rank, delay)

    def restart_due(self) -> None:
        now = time.monotonic()
        for rank, when in list(self.restart_at.items()):
            if when <= now:
                del self.restart_at[rank]
                logger.info("starting engine dp%d again", rank)
                self._spawn(rank)

"""The engine-core processes one launcher runs on its node (all ranks on a single node; a
slice of them on each node of a multi-node deployment): spawn with the rank's own CPU share,
notice a death at once (process sentinel), and restart a dead rank when asked, with a backoff
so that a rank that cannot start does not spin."""

from __future__ import annotations

import logging
import multiprocessing
import time
from dataclasses import dataclass

from parashift.serve.engine_process import CpuShare, run_engine

logger = logging.getLogger(__name__)

FIRST_RESTART_DELAY_S = 1.0  # doubled for each quick death in a row, up to the maximum
MAX_RESTART_DELAY_S = 30.0
STABLE_AFTER_S = 60.0  # a rank that lived this long starts again from the first delay


@dataclass
class EngineDeath:
    rank: int
    pid: int  # the dead incarnation
    reason: str


class LocalEngines:
    def __init__(self, ranks: list[int], handshake_address: str, shares: dict[int, CpuShare],
                 log_level: str, handshake_timeout: float, restart: bool = False):
        self.ranks = ranks
        self.handshake_address = handshake_address
        self.shares = shares
        self.log_level = log_level
        self.handshake_timeout = handshake_timeout
        self.restart = restart
        self.procs: dict[int, multiprocessing.Process] = {}
        self.started_at: dict[int, float] = {}
        self.restart_delay: dict[int, float] = {}
        self.restart_at: dict[int, float] = {}  # dead ranks waiting for their restart
        self._mp = multiprocessing.get_context("spawn")

    def start(self) -> None:
        for rank in self.ranks:
            self._spawn(rank)

    def _spawn(self, rank: int) -> None:
        proc = self._mp.Process(target=run_engine, name=f"parashift-engine-dp{rank}", args=(
            rank, self.handshake_address, self.log_level, self.shares.get(rank, CpuShare()),
            self.handshake_timeout))
        proc.start()
        self.procs[rank] = proc
        self.started_at[rank] = time.monotonic()

    def reap(self) -> list[EngineDeath]:
        """Ranks that died since the last call; with restart on, each gets a restart time."""
        deaths = []
        for rank, proc in list(self.procs.items()):
            if proc.exitcode is None:
                continue
            del self.procs[rank]
            deaths.append(EngineDeath(rank, proc.pid, f"process exited with code {proc.exitcode}"))
            if self.restart:
                lived = time.monotonic() - self.started_at[rank]
                previous = self.restart_delay.get(rank)
                delay = (FIRST_RESTART_DELAY_S if previous is None or lived > STABLE_AFTER_S
                         else min(MAX_RESTART_DELAY_S, 2 * previous))
                self.restart_delay[rank] = delay
                self.restart_at[rank] = time.monotonic() + delay
                logger.info("restarting engine dp%d in %.0f s", rank, delay)
        return deaths

    def restart_due(self) -> None:
        now = time.monotonic()
        for rank, when in list(self.restart_at.items()):
            if when <= now:
                del self.restart_at[rank]
                logger.info("starting engine dp%d again", rank)
                self._spawn(rank)

    def stop(self, timeout: float = 10.0) -> None:
        procs = list(self.procs.values())
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        join_all(procs, timeout)


def join_all(procs: list[multiprocessing.Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            logger.warning("%s did not stop in time; killing it", proc.name)
            proc.kill()
            proc.join(5)

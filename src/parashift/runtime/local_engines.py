"""The engine-core processes one launcher runs on its node (all ranks on a single node; a
slice of them on each node of a multi-node deployment): spawn each with its placement from
the mesh (name, cores, its workers' devices),
notice a death at once (process sentinel), and restart a dead rank when asked, with a backoff
so that a rank that cannot start does not spin."""

from __future__ import annotations

import logging
import multiprocessing
import secrets

from parashift.engine.engine_process import run_engine
from parashift.kv_tiers import shm_files
from parashift.processes import exit_after, join_within
from parashift.runtime import child_processes
from parashift.runtime.restart_policy import EngineDeath, RestartPolicy
from parashift.runtime.scale import free_memory_bytes, memory_room, tree_rss_bytes
from parashift.strategies.mesh import EnginePlacement

logger = logging.getLogger(__name__)


class LocalEngines:
    def __init__(self, placements: dict[int, EnginePlacement], handshake_address: str,
                 log_level: str, handshake_timeout: float, restart: bool = False):
        self.restarts = RestartPolicy(restart)
        self.ranks = sorted(placements)
        self.handshake_address = handshake_address
        self.placements = placements
        self.log_level = log_level
        self.handshake_timeout = handshake_timeout
        self.procs: dict[int, multiprocessing.Process] = {}
        self._mp = child_processes.context()
        # Each rank's Hello carries its token (handed over in the process's arguments, never
        # a command line): no other peer can say Hello as one of this node's ranks.
        self.tokens = {rank: secrets.token_bytes(16) for rank in self.ranks}

    def start(self) -> None:
        for rank in self.ranks:
            self._spawn(rank)

    def add(self, rank: int, placement: EnginePlacement) -> None:
        """A new rank (a scale-up), with a fresh token its Hello must carry."""
        self.placements[rank] = placement
        self.ranks = sorted({*self.ranks, rank})
        self.tokens[rank] = secrets.token_bytes(16)
        self._spawn(rank)

    def retire(self, rank: int, timeout: float = 10.0, reserve: bool = True) -> None:
        """The rank leaves (a scale-down, or a failed scale-up): its process stops (SIGTERM,
        then SIGKILL after `timeout`) and is not restarted; `reap` does not report it.
        `reserve`: no other node may take the rank meanwhile (`reserve`)."""
        self.restarts.forget(rank)
        proc = self.procs.pop(rank, None)
        self.placements.pop(rank, None)
        if reserve:
            self.reserve(rank)
        else:
            self.tokens.pop(rank, None)
        self.ranks = [r for r in self.ranks if r != rank]
        if proc is not None:
            if proc.is_alive():
                proc.terminate()
            join_all([proc], timeout)

    def reserve(self, rank: int) -> None:
        """A rank this launcher may start later: a token nobody holds, so that no Hello as it
        is answered meanwhile (the handshake answers a rank without a token for other nodes)."""
        self.tokens[rank] = secrets.token_bytes(16)

    def pid(self, rank: int) -> int | None:
        proc = self.procs.get(rank)
        return proc.pid if proc is not None and proc.exitcode is None else None

    def room(self, n: int) -> str:
        """Why n more ranks would not fit this machine's memory ("" if they fit)."""
        return memory_room(self._rank_bytes, free_memory_bytes)(n)

    def _rank_bytes(self) -> int:
        """What a running rank holds in memory, measured: the largest rank's process tree."""
        pids = [self.pid(r) for r in self.ranks]
        return max((tree_rss_bytes(pid) for pid in pids if pid is not None), default=0)

    def restart_due(self) -> None:
        for rank in self.restarts.due():
            self._spawn(rank)

    def _spawn(self, rank: int) -> None:
        placement = self.placements[rank]
        proc = self._mp.Process(target=exit_after, name=placement.process_name, args=(
            run_engine, rank, self.handshake_address, self.log_level, placement,
            self.handshake_timeout, self.tokens[rank]))
        proc.start()
        self.procs[rank] = proc
        self.restarts.started(rank)

    def reap(self) -> list[EngineDeath]:
        """Ranks that died since the last call; with restart on, each gets a restart time."""
        deaths = []
        for rank, proc in list(self.procs.items()):
            if proc.exitcode is None:
                continue
            del self.procs[rank]
            deaths.append(EngineDeath(rank, proc.pid, f"process exited with code {proc.exitcode}"))
            self.restarts.died(rank)
            sweep_boards_of(proc.pid)
        return deaths

    def kill(self, rank: int, incarnation: int) -> None:
        """SIGKILL the engine process `incarnation` (its pid) of `rank`, hung: it no longer
        answers (`reap` sees it go). A verdict about an earlier process of the rank is stale."""
        proc = self.procs.get(rank)
        if proc is None or not proc.is_alive():
            return
        if proc.pid != incarnation:
            logger.info("engine dp%d: the silent process %d has been replaced by %d; ignoring",
                        rank, incarnation, proc.pid)
            return
        logger.error("engine dp%d is hung (pid %d): killing it", rank, incarnation)
        proc.kill()

    def terminate(self, rank: int, incarnation: int) -> None:
        """SIGTERM rank's engine if it is still the process `incarnation` (its pid)."""
        proc = self.procs.get(rank)
        if proc is not None and proc.is_alive() and proc.pid == incarnation:
            proc.terminate()

    def stop_all(self) -> None:
        """Ask every live engine to stop (SIGTERM) without waiting: `reap` sees them go."""
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()

    def stop(self, timeout: float = 10.0) -> None:
        procs = list(self.procs.values())
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        join_all(procs, timeout)


def join_all(procs: list[multiprocessing.Process], timeout: float) -> None:
    join_within(procs, timeout)
    for proc in procs:
        if proc.is_alive():
            logger.warning("%s did not stop in time; killing it", proc.name)
            proc.kill()
            proc.join(5)
            sweep_boards_of(proc.pid)


def sweep_boards_of(pid: int) -> None:
    """A killed engine could not unlink its KV job board: its launcher does. A failure is
    logged, not raised: the engine's death is what its caller is recording."""
    try:
        shm_files.sweep_boards_of(pid)
    except OSError as e:
        logger.warning("could not sweep the KV job boards of engine pid %d: %s", pid, e)

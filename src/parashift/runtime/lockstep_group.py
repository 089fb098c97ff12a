"""The launcher's view of a lockstep group (expert parallel over engines): every engine runs
every step, so one dead engine stops them all. On a death the launcher stops the others at
once, on its node and, through their launchers (StopGroup), on the others: their requests then
fail fast, none waits on a collective that cannot finish. A restarted group meets at a fresh
store (the launcher hosts it: distributed/group_store.py), so that no engine of the old
incarnation can join the new one. An engine the coordinator hears no heartbeat from is hung (a
dead one is reaped sooner): its peers would wait on it in a collective, so it is killed (by
its node's launcher), and its death then stops the group like any other."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import zmq

from parashift.distributed.group_store import GroupStoreServer
from parashift.wire import protocol as p
from parashift.wire.sockets import subscriber

logger = logging.getLogger(__name__)


class LockstepGroup:
    def __init__(self, num_engines: int):
        self.num_engines = num_engines
        self.verdicts: zmq.Socket | None = None  # the coordinator's EngineDead for silent ranks
        self.incarnation = 0
        self.store: GroupStoreServer | None = None
        self._where: tuple[zmq.Context, Callable[[int], str]] | None = None  # (`open`'s)
        self.broken = False
        self.ready: set[int] = set()  # ranks of this incarnation that answered READY
        self.pids: dict[int, int] = {}  # each rank's engine process, as its Hello said

    def open(self, ctx: zmq.Context, where: Callable[[int], str]) -> None:
        """Host the store, at `where(incarnation)` for each incarnation."""
        self._where = ctx, where
        self._open_store()

    def _open_store(self) -> None:
        ctx, where = self._where
        self.store = GroupStoreServer(ctx, where(self.incarnation))
        self.store.start()

    @property
    def address(self) -> str | None:
        return self.store.address if self.store is not None else None

    def close(self) -> None:
        if self.store is not None:
            self.store.stop()
            self.store = None

    def watch(self, ctx: zmq.Context, coordinator_publish: str) -> None:
        self.verdicts = subscriber(ctx, coordinator_publish)

    def hung_ranks(self) -> Iterator[tuple[int, int]]:
        """(rank, incarnation) of the group's engines the coordinator declared silent since the
        last call (this node's and other nodes'). The verdict names the process that went
        silent: after a group restart the coordinator still times out the stopped
        incarnation, and that must never kill the new one while it loads."""
        while self.verdicts is not None:
            try:
                msg = p.decode_or_drop(self.verdicts.recv(zmq.NOBLOCK), p.FromCoordinator,
                                       "verdicts")
            except zmq.Again:
                return
            if isinstance(msg, p.EngineDead) and 0 <= msg.rank < self.num_engines:
                yield msg.rank, msg.incarnation

    def on_death(self, rank: int) -> bool:
        """An engine died. True if that breaks the group now (the launcher must stop the
        others); False if it was already broken (e.g. one the launcher stopped)."""
        if self.broken:
            return False
        logger.error("engine dp%d of the expert-parallel group died: stopping the group", rank)
        self.broken = True
        self.incarnation += 1
        self.close()  # the old incarnation cannot meet again
        if self._where is not None:
            self._open_store()
        self.ready.clear()
        self.pids.clear()
        return True

    def on_ready(self, rank: int, pid: int) -> None:
        self.ready.add(rank)
        self.pids[rank] = pid
        if self.broken and len(self.ready) == self.num_engines:
            logger.info("the expert-parallel group serves again (incarnation %d)",
                        self.incarnation)
            self.broken = False

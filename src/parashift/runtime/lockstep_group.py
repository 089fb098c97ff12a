"""The launcher's view of a lockstep group (expert parallel over engines): every engine runs
every step, so one dead engine stops them all. On a death the launcher stops the others at
once (their requests then fail fast, none waits on a collective that cannot finish), and a
restarted group meets at a fresh store (the launcher hosts it), so that no engine of the old
incarnation can join the new one. An engine the coordinator hears no heartbeat from is hung (a
dead one is reaped sooner): its peers would wait on it in a collective, so the launcher kills
it, and its death then stops the group like any other."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import zmq

from parashift.distributed.expert_group import GroupStore
from parashift.wire import protocol as p
from parashift.wire.sockets import subscriber

logger = logging.getLogger(__name__)


class LockstepGroup:
    def __init__(self, num_engines: int, local_ranks: list[int], host: str = "127.0.0.1"):
        self.num_engines = num_engines
        self.local_ranks = set(local_ranks)
        self.host = host
        self.verdicts: zmq.Socket | None = None  # the coordinator's EngineDead for silent ranks
        self.incarnation = 0
        self.store = GroupStore(host)
        self.broken = False
        self.ready: set[int] = set()  # ranks of this incarnation that answered READY

    @property
    def address(self) -> str:
        return self.store.address

    def watch(self, ctx: zmq.Context, coordinator_publish: str) -> None:
        self.verdicts = subscriber(ctx, coordinator_publish)

    def hung_ranks(self) -> Iterator[tuple[int, int]]:
        """(rank, incarnation) of this node's engines the coordinator declared silent since the
        last call. The verdict names the process that went silent: after a group restart the
        coordinator still times out the stopped incarnation, and that must never kill the new
        one while it loads."""
        while self.verdicts is not None:
            try:
                msg = p.decode_or_drop(self.verdicts.recv(zmq.NOBLOCK), p.FromCoordinator,
                                       "verdicts")
            except zmq.Again:
                return
            if isinstance(msg, p.EngineDead) and msg.rank in self.local_ranks:
                yield msg.rank, msg.incarnation

    def on_death(self, rank: int) -> bool:
        """An engine died. True if that breaks the group now (the launcher must stop the
        others); False if it was already broken (e.g. one the launcher stopped)."""
        if self.broken:
            return False
        logger.error("engine dp%d of the expert-parallel group died: stopping the group", rank)
        self.broken = True
        self.incarnation += 1
        self.store = GroupStore(self.host)  # a new port: the old incarnation cannot meet here
        self.ready.clear()
        return True

    def on_ready(self, rank: int) -> None:
        self.ready.add(rank)
        if self.broken and len(self.ready) == self.num_engines:
            logger.info("the expert-parallel group serves again (incarnation %d)",
                        self.incarnation)
            self.broken = False

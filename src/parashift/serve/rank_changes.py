"""How an API server's engine client (serve/engine_client.py) follows its ranks coming and
going: a rank ready (first start, restart, or a scale-up's new rank), a scale asked of the
launcher (runtime/scale.py) and answered once the new size serves, a rank draining and removed
by a scale-down, a rank dead (its lockstep peers with it). A mixin of EngineClient, whose rank
table, routes, router, loads and requests in flight it updates."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq

from parashift.serve.engine_errors import EngineDeadError, RankDrainingError
from parashift.serve.engine_ranks import RankStatus
from parashift.wire import protocol as p
from parashift.wire.sockets import send_now

logger = logging.getLogger(__name__)

READY_AFTER_SCALE_S = 30.0  # how long a scale's answer waits for the new ranks' EngineReady


class RankChanges:
    def on_ready(self, msg: p.EngineReady, route: bytes | None = None) -> None:
        """An engine (first start or restarted incarnation) can take requests, sent to
        `route`, its identity."""
        left = self.ranks.on_ready(msg)
        self._rank_news.set()
        if left is None:
            p.log_dropped("control", f"an EngineReady of rank {msg.rank}, outside the launch")
            return
        if route is not None:
            self.routes[msg.rank] = route
        self.loads.new_incarnation(msg.rank)
        self.block_size = msg.block_size
        self.router.add_rank(msg.rank, msg.num_blocks, msg.kv_tier, msg.kv_tier_blocks)
        if left == RankStatus.DEAD:
            logger.info("engine dp%d is back (%d KV blocks)", msg.rank, msg.num_blocks)
        else:
            logger.info("engine dp%d ready (%d KV blocks)", msg.rank, msg.num_blocks)

    async def scale(self, size: int) -> p.ScaleResult:
        """Asks the launcher for `size` ranks; its answer, when that size serves (or why not)."""
        call_id = next(self._scale_ids)
        future = asyncio.get_running_loop().create_future()
        self._scales[call_id] = future
        msg = [self.launcher, p.encode(p.ScaleRequest(self.client_index, call_id, size))]
        try:
            send_now(self.requests, msg)
            result = await future
        except zmq.ZMQError as e:
            return p.ScaleResult(call_id, self.ranks.size, f"the launcher cannot be reached "
                                 f"({e})", 503)
        finally:
            self._scales.pop(call_id, None)
        # The new ranks' EngineReady reach this server on their own links: the answer waits
        # for them (a scale-down's RankRemoved came before the answer, on the launcher's).
        deadline = time.monotonic() + READY_AFTER_SCALE_S
        while (not result.error and time.monotonic() < deadline
               and len(self.alive_engines()) < result.size):
            self._rank_news.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._rank_news.wait(), deadline - time.monotonic())
        return result

    def drain_rank(self, rank: int) -> None:
        """A scale-down leaves `rank` out: nothing more goes there, and each request it holds
        hears it (one that has not started moves; serve/generation.py)."""
        if self.ranks.on_draining(rank):
            logger.info("engine dp%d is draining (a scale-down)", rank)
            self.in_flight.tell_engine(rank, RankDrainingError(
                f"engine dp{rank} is leaving the deployment (a scale-down)"))

    def remove_rank(self, rank: int, reason: str) -> None:
        """`rank` left: what it still held moves (not streamed yet) or ends with `reason`;
        the launcher hears that this server let it go (then it stops the engine)."""
        if self.ranks.status(rank) not in (None, RankStatus.ABSENT):
            logger.info("engine dp%d left the deployment: %s", rank, reason)
            self.in_flight.fail_engine(rank, EngineDeadError(reason, rank))
            self.ranks.on_removed(rank)
            self.routes.pop(rank, None)
            self.router.remove(rank)
            self.loads.vector.pop(rank, None)
            self.loads.new_incarnation(rank)
        with contextlib.suppress(zmq.ZMQError):
            send_now(self.requests, [self.launcher, p.encode(p.RankRemovedSeen(
                self.client_index, rank))])

    def mark_dead(self, rank: int, reason: str, incarnation: int = 0) -> None:
        if self.ranks.status(rank) in (None, RankStatus.DEAD, RankStatus.ABSENT):
            return
        ready = self.ranks.ranks[rank].ready
        if incarnation and ready is not None and ready.incarnation != incarnation:
            return  # news about an earlier incarnation; the rank has been restarted since
        self._mark_dead(rank, reason)
        if ready is not None and ready.lockstep:
            # Its lockstep peers cannot step without it and are about to die too: mark them
            # now, in this same call, so that no failover lands on one of them before its own
            # death is heard (it would then fail a second time). They come back with the
            # restarted group's EngineReady.
            for peer, peer_ready in self.ranks.ever_ready().items():
                if peer_ready.lockstep and not self.ranks.is_dead(peer):
                    self._mark_dead(peer, f"stopped with its expert-parallel group "
                                          f"(dp{rank} is down)")

    def _mark_dead(self, rank: int, reason: str) -> None:
        logger.error("engine dp%d is down: %s", rank, reason)
        self.ranks.on_dead(rank, reason)
        # The reason stays in the log: an engine's is its traceback's last line, which may
        # quote another client's request.
        self.in_flight.fail_engine(rank, EngineDeadError(
            f"engine dp{rank} died (the server's log says why)", rank))

"""The DP coordinator process (dp > 1): engines push their load whenever it changes; the
coordinator publishes the whole vector to every API server at most every 100 ms, and a
heartbeat once a second when nothing changes, so that every API server routes on the same,
fresh view of all ranks -- not just on the requests it sent itself.

With expert parallel over engines it also starts the waves: an engine that gets work while
idle asks for one, and the coordinator passes the call on to every engine at once.

It also watches the engines' own heartbeats: a rank that has joined and then stays silent for
`heartbeat_timeout` seconds is declared dead to every API server. That is how the death of an
engine on another node (or of the whole node) is noticed; local deaths are seen sooner by the
launcher, through the process sentinel."""

from __future__ import annotations

import logging
import signal
import socket
import time
from typing import Any

import zmq

from parashift.processes import die_with_parent, set_process_name, setup_child_logging
from parashift.types.outputs import SchedulerStats
from parashift.wire import protocol as p
from parashift.wire.cluster_auth import HeadKeys, rank_principal, speaks_for
from parashift.wire.sockets import bind, zmq_context

logger = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.1
HEARTBEAT_INTERVAL_S = 1.0



def idle(rank: int) -> p.EngineLoad:
    """The load of a rank that has none (not heard from yet, or dead)."""
    return p.EngineLoad(rank, SchedulerStats(0, 0, 0.0))


class Coordinator:
    def __init__(self, num_engines: int, stats_address: str, publish_address: str,
                 heartbeat_timeout: float = 5.0, bound: dict[str, socket.socket] | None = None,
                 head_keys: HeadKeys | None = None):
        """`head_keys`: over CURVE, whose links it accepts (the head's, the ranks', and the
        nodes' subscriptions); a message speaking for a rank counts only from that rank's."""
        self.ctx = zmq_context(role=head_keys.role(cluster=True) if head_keys else None)
        self.stats = self.ctx.socket(zmq.PULL)
        self.stats.setsockopt(zmq.LINGER, 0)
        bind(self.stats, stats_address, bound)
        self.publish = self.ctx.socket(zmq.PUB)
        self.publish.setsockopt(zmq.LINGER, 0)
        bind(self.publish, publish_address, bound)
        self.load = [idle(rank) for rank in range(num_engines)]
        self.heartbeat_timeout = heartbeat_timeout
        self.last_seen: dict[int, tuple[float, int]] = {}  # rank -> (time, incarnation)
        self.stopping = False

    def run(self) -> None:
        seq, changed, last_sent = 0, False, 0.0
        while not self.stopping:
            due = last_sent + (PUBLISH_INTERVAL_S if changed else HEARTBEAT_INTERVAL_S)
            if self.stats.poll(max(0, int((due - time.monotonic()) * 1000))):
                changed |= self._drain()
            changed |= self._declare_silent_ranks_dead()
            # A change brings the next publication forward to 100 ms after the last one.
            due = last_sent + (PUBLISH_INTERVAL_S if changed else HEARTBEAT_INTERVAL_S)
            if time.monotonic() < due:
                continue
            seq += 1
            self.publish.send(p.encode(p.LoadVector(seq, list(self.load))))
            last_sent, changed = time.monotonic(), False

    def _drain(self) -> bool:
        changed = False
        while True:
            try:
                frame = self.stats.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return changed
            msg = p.decode_or_drop(frame.buffer, p.ToEngineLoad, "load")
            if (msg is None or not 0 <= msg.rank < len(self.load)
                    or not speaks_for(frame, rank_principal(msg.rank), "load")):
                continue
            if isinstance(msg, p.StartWave):  # on to every engine at once
                self.publish.send(p.encode(p.StartWave(msg.wave)))
            elif isinstance(msg, p.Heartbeat) and msg.leaving:
                # A clean stop (a scale-down, the launch's end): its silence is no death.
                if self.last_seen.pop(msg.rank, None) is not None:
                    logger.info("engine dp%d left", msg.rank)
                if self.load[msg.rank] != idle(msg.rank):
                    self.load[msg.rank] = idle(msg.rank)
                    changed = True
            elif isinstance(msg, p.Heartbeat):
                if msg.rank not in self.last_seen:
                    logger.info("engine dp%d is sending heartbeats", msg.rank)
                self.last_seen[msg.rank] = (time.monotonic(), msg.incarnation)
            elif self.load[msg.rank] != msg:
                self.load[msg.rank] = msg
                changed = True

    def _declare_silent_ranks_dead(self) -> bool:
        now = time.monotonic()
        silent = [(rank, incarnation) for rank, (seen, incarnation) in self.last_seen.items()
                  if now - seen > self.heartbeat_timeout]
        for rank, incarnation in silent:
            reason = f"no heartbeat for {self.heartbeat_timeout:g} s"
            logger.error("engine dp%d: %s; declaring it dead", rank, reason)
            del self.last_seen[rank]  # until a new incarnation heartbeats
            self.load[rank] = idle(rank)  # a dead rank carries no load
            self.publish.send(p.encode(p.EngineDead(rank, reason, incarnation)))
        return bool(silent)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def run_coordinator(num_engines: int, stats_address: str, publish_address: str,
                    heartbeat_timeout: float, log_level: str,
                    bound: dict[str, socket.socket] | None = None,
                    head_keys: HeadKeys | None = None) -> None:
    """Process entry point (multiprocessing target)."""
    set_process_name("parashift-dp-coordinator")
    die_with_parent()
    setup_child_logging(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    coordinator = Coordinator(num_engines, stats_address, publish_address, heartbeat_timeout,
                              bound, head_keys)

    def on_term(*_: Any) -> None:
        coordinator.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    try:
        coordinator.run()
    finally:
        coordinator.close()

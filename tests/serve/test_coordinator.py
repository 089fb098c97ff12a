"""The DP coordinator over real ZMQ sockets: load changes are published within ~100 ms, and a
heartbeat keeps coming when nothing changes."""

from __future__ import annotations

import contextlib
import threading
import time

import zmq

from parashift.runtime.coordinator import HEARTBEAT_INTERVAL_S, Coordinator
from parashift.wire import protocol as p


@contextlib.contextmanager
def running_coordinator(tmp_path, **kwargs):
    """A coordinator for 2 ranks in a thread, with an engine's PUSH and an API server's SUB."""
    load_address, pub_address = f"ipc://{tmp_path}/load", f"ipc://{tmp_path}/pub"
    coordinator = Coordinator(2, load_address, pub_address, **kwargs)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub_address)
        push = ctx.socket(zmq.PUSH)
        push.connect(load_address)
        yield coordinator, sub, push
    finally:
        coordinator.stopping = True
        thread.join(5)
        coordinator.close()
        ctx.destroy(linger=0)


def test_publishes_changes_fast_and_heartbeats(tmp_path):
    with running_coordinator(tmp_path) as (_, sub, push):
        assert sub.poll(int(2000 * HEARTBEAT_INTERVAL_S))  # joined: a heartbeat arrives
        first = p.decode(sub.recv(), p.LoadVector)
        assert [load.rank for load in first.loads] == [0, 1]

        sent = time.monotonic()
        push.send(p.encode(p.EngineLoad(1, 3, 5, 0.25)))
        while True:
            assert sub.poll(2000)
            vector = p.decode(sub.recv(), p.LoadVector)
            if vector.loads[1].num_waiting == 3:
                break
        assert time.monotonic() - sent < 0.5  # well before the next heartbeat
        assert vector.loads[1] == p.EngineLoad(1, 3, 5, 0.25)
        assert vector.seq > first.seq

        start = time.monotonic()  # no change: the next message is a heartbeat, ~1 s later
        assert sub.poll(int(3000 * HEARTBEAT_INTERVAL_S))
        heartbeat = p.decode(sub.recv(), p.LoadVector)
        assert heartbeat.loads == vector.loads
        assert time.monotonic() - start > 0.5 * HEARTBEAT_INTERVAL_S


def next_death(sub, within: float) -> tuple[p.EngineDead | None, float]:
    """The next EngineDead the coordinator publishes within `within` s, and when."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        if sub.poll(int(left * 1000)):
            msg = p.decode(sub.recv(), p.FromCoordinator)
            if isinstance(msg, p.EngineDead):
                return msg, time.monotonic()
    return None, time.monotonic()


def test_a_silent_rank_is_declared_dead_once_per_incarnation(tmp_path):
    with running_coordinator(tmp_path, heartbeat_timeout=1.5) as (coordinator, sub, push):
        assert sub.poll(3000)  # joined
        # Rank 1 never heartbeats (not started yet): it is never declared dead.
        push.send(p.encode(p.Heartbeat(0, 111)))
        push.send(p.encode(p.EngineLoad(0, 2, 1, 0.5)))
        sent = time.monotonic()
        death, at = next_death(sub, 5)
        assert death == p.EngineDead(0, "no heartbeat for 1.5 s", 111)
        assert 1.4 < at - sent < 4
        assert coordinator.load[0] == p.EngineLoad(0, 0, 0, 0.0)  # a dead rank carries no load
        assert next_death(sub, 2.5)[0] is None  # said once, not every second

        for _ in range(3):  # a new incarnation that keeps beating stays alive
            push.send(p.encode(p.Heartbeat(0, 222)))
            assert next_death(sub, 1.0)[0] is None
        death, _ = next_death(sub, 5)  # and when it goes silent, its own incarnation is named
        assert death is not None and (death.rank, death.incarnation) == (0, 222)

"""The DP coordinator over real ZMQ sockets: a load change is published on its own, without
waiting for the heartbeat, and nothing is published for what changes nothing; a heartbeat
keeps coming when nothing changes; a silent rank is declared dead once per incarnation."""

from __future__ import annotations

import contextlib
import threading
import time

import zmq

from parashift.runtime import coordinator as coordinator_module
from parashift.runtime.coordinator import Coordinator
from parashift.types.outputs import SchedulerStats
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
        push.send(p.encode(p.Heartbeat(-1, 0)))  # no such rank: it only wakes the loop
        thread.join(5)
        assert not thread.is_alive()
        coordinator.close()
        ctx.destroy(linger=0)


def next_vector(sub, until, timeout: float = 30.0) -> tuple[p.LoadVector, list[p.EngineDead]]:
    """The first LoadVector published for which `until(vector)` holds, and the deaths
    published before it."""
    deaths = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sub.poll(int(left * 1000)), "no such load vector published"
        msg = p.decode(sub.recv(), p.FromCoordinator)
        if isinstance(msg, p.EngineDead):
            deaths.append(msg)
        elif isinstance(msg, p.LoadVector) and until(msg):
            return msg, deaths


def subscribed(sub, push) -> p.LoadVector:
    """A SUB's subscription reaches the PUB a moment after it connects (what is published
    before is lost): push changes of rank 0 until one is published, then wait for the last
    one, so that nothing pushed is still to be published. The vector that showed it."""
    n = 0
    while not sub.poll(100):
        n += 1
        assert n < 300, "the subscription never came up"
        push.send(p.encode(p.EngineLoad(0, SchedulerStats(n, 0, 0.0))))
    return next_vector(sub, lambda v: v.loads[0].stats.num_waiting == n)[0]


def test_a_change_is_published_on_its_own_and_nothing_else_is(tmp_path, monkeypatch):
    """With the heartbeat an hour away, only a change can make the coordinator publish: the
    change comes next, and what changes nothing (the same load again, an engine's heartbeat)
    sends nothing before it."""
    monkeypatch.setattr(coordinator_module, "HEARTBEAT_INTERVAL_S", 3600.0)
    with running_coordinator(tmp_path, heartbeat_timeout=3600.0) as (_, sub, push):
        first = subscribed(sub, push)
        push.send(p.encode(first.loads[0]))  # the same load again
        push.send(p.encode(p.Heartbeat(1, 4242)))
        push.send(p.encode(p.EngineLoad(1, SchedulerStats(3, 5, 0.25))))
        assert sub.poll(30_000)
        vector = p.decode(sub.recv(), p.LoadVector)
        assert vector.seq == first.seq + 1
        assert vector.loads == [first.loads[0], p.EngineLoad(1, SchedulerStats(3, 5, 0.25))]


def test_heartbeats_repeat_the_last_vector_when_nothing_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(coordinator_module, "HEARTBEAT_INTERVAL_S", 0.2)
    with running_coordinator(tmp_path) as (_, sub, push):
        last = subscribed(sub, push)
        for _ in range(3):
            assert sub.poll(30_000)
            heartbeat = p.decode(sub.recv(), p.LoadVector)
            assert heartbeat.seq == last.seq + 1 and heartbeat.loads == last.loads
            last = heartbeat


def next_death(sub, within: float) -> p.EngineDead | None:
    """The next EngineDead the coordinator publishes within `within` s."""
    deadline = time.monotonic() + within
    while (left := deadline - time.monotonic()) > 0:
        if sub.poll(int(left * 1000)):
            msg = p.decode(sub.recv(), p.FromCoordinator)
            if isinstance(msg, p.EngineDead):
                return msg
    return None


def test_a_silent_rank_is_declared_dead_once_per_incarnation(tmp_path):
    with running_coordinator(tmp_path, heartbeat_timeout=1.5) as (coordinator, sub, push):
        subscribed(sub, push)
        # Rank 1 never heartbeats (not started yet): it is never declared dead.
        push.send(p.encode(p.Heartbeat(0, 111)))
        push.send(p.encode(p.EngineLoad(0, SchedulerStats(2, 1, 0.5))))
        assert next_death(sub, 30) == p.EngineDead(0, "no heartbeat for 1.5 s", 111)
        # Said once: the coordinator checks for silent ranks on every pass of its loop, and
        # publishes this change on a later pass, with no verdict before it.
        push.send(p.encode(p.EngineLoad(1, SchedulerStats(1, 0, 0.0))))
        vector, deaths = next_vector(sub, lambda v: v.loads[1].stats.num_waiting == 1)
        assert deaths == []
        # a dead rank carries no load
        assert vector.loads[0] == p.EngineLoad(0, SchedulerStats(0, 0, 0.0))

        for _ in range(3):  # a new incarnation that keeps beating stays alive
            push.send(p.encode(p.Heartbeat(0, 222)))
            assert next_death(sub, 1.0) is None
        death = next_death(sub, 30)  # and when it goes silent, its own incarnation is named
        assert death is not None and (death.rank, death.incarnation) == (0, 222)


def test_a_rank_that_says_it_leaves_is_not_declared_dead(tmp_path, caplog):
    """A clean stop (a scale-down) ends with a leaving heartbeat: its load goes idle and its
    silence after is no death. Driven by hand: no thread, no clock."""
    import logging

    load_address, pub_address = f"ipc://{tmp_path}/load", f"ipc://{tmp_path}/pub"
    coordinator = Coordinator(2, load_address, pub_address, heartbeat_timeout=0.0)
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.connect(load_address)
        push.send(p.encode(p.Heartbeat(1, 7)))
        push.send(p.encode(p.EngineLoad(1, SchedulerStats(2, 3, 0.5))))
        push.send(p.encode(p.Heartbeat(1, 7, leaving=True)))
        with caplog.at_level(logging.INFO, logger=coordinator_module.__name__):
            while "engine dp1 left" not in caplog.text:
                assert coordinator.stats.poll(30_000)
                coordinator._drain()
        assert coordinator.load[1] == coordinator_module.idle(1)
        assert coordinator._declare_silent_ranks_dead() is False
    finally:
        coordinator.close()
        ctx.destroy(linger=0)

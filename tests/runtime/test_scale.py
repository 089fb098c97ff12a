"""The launcher's scale state machine (runtime/scale.py), case by case: what it refuses, what
it starts or drains, when a drain is over, and what it answers. Served end to end:
tests/serve/test_elastic_dp.py."""

from __future__ import annotations

import time

import pytest

from parashift.runtime.scale import (
    DRAIN_SETTLE_S,
    Phase,
    ScaleLimits,
    Scaler,
    free_memory_bytes,
    memory_room,
    tree_rss_bytes,
)
from parashift.types.outputs import SchedulerStats
from parashift.wire import protocol as p

GIB = 1 << 30


def scaler(size: int = 1, capacity: int = 3, rank_gib: float = 1.0, free_gib: float = 10.0,
           refusal: str = "") -> Scaler:
    return Scaler(ScaleLimits(capacity, 600.0, 60.0, refusal), size,
                  memory_room(lambda: int(rank_gib * GIB), lambda: int(free_gib * GIB)))


def ask(size: int, call_id: int = 7) -> p.ScaleRequest:
    return p.ScaleRequest(0, call_id, size)


def test_a_scale_within_the_capacity_and_the_memory_starts():
    s = scaler()
    assert s.refuse(ask(3)) is None
    job = s.begin(ask(3))
    assert (job.phase, job.ranks, job.target) == (Phase.STARTING, [1, 2], 3)
    index, answer = s.finish()
    assert (index, answer) == (0, p.ScaleResult(7, 3))
    assert s.size == 3 and s.job is None


def test_what_is_refused_and_why():
    s = scaler(size=2)
    over = s.refuse(ask(4))
    assert over.status == 400 and "--data-parallel-size-max 3" in over.error
    assert over.size == 2
    same = s.refuse(ask(2))
    assert same == p.ScaleResult(7, 2)  # nothing to do: answered at once, no error
    cannot = scaler(refusal="expert-parallel lockstep groups do not scale").refuse(ask(2))
    assert cannot.status == 400 and "lockstep" in cannot.error


def test_a_scale_up_past_the_free_memory_is_refused_naming_it():
    refused = scaler(size=1, rank_gib=4.0, free_gib=6.0).refuse(ask(3))
    assert refused.status == 409
    assert "8.0 GiB" in refused.error and "6.0 GiB available" in refused.error
    assert scaler(size=1, rank_gib=4.0, free_gib=6.0).refuse(ask(2)) is None
    assert scaler(size=3, rank_gib=99.0, free_gib=0.0).refuse(ask(1)) is None  # down: free


def load(rank: int, waiting: int, running: int) -> p.EngineLoad:
    return p.EngineLoad(rank, SchedulerStats(waiting, running, 0.0))


def test_a_drain_ends_when_every_leaving_rank_is_empty_in_a_later_vector():
    s = scaler(size=3)
    job = s.begin(ask(1))
    assert (job.phase, job.ranks) == (Phase.DRAINING, [1, 2])
    after = job.began + DRAIN_SETTLE_S + 1
    assert not s.drained({1: (after, load(1, 0, 0))})  # dp2 not heard from
    assert not s.drained({1: (after, load(1, 0, 0)), 2: (after, load(2, 0, 1))})  # busy
    # Empty, but in a vector heard before the rank could have seen the last requests.
    assert not s.drained({1: (job.began, load(1, 0, 0)), 2: (after, load(2, 0, 0))})
    assert s.drained({1: (after, load(1, 0, 0)), 2: (after, load(2, 0, 0))})
    index, answer = s.finish()
    assert answer == p.ScaleResult(7, 1) and s.size == 1


def test_a_failed_scale_keeps_the_size_and_says_why():
    s = scaler(size=1)
    s.begin(ask(2))
    _, answer = s.finish("engine dp1 process exited with code 1 while starting", 503)
    assert answer == p.ScaleResult(7, 1, "engine dp1 process exited with code 1 while "
                                         "starting", 503)
    assert s.size == 1 and s.job is None


def test_overdue_uses_the_phases_own_limit():
    s = Scaler(ScaleLimits(3, startup_timeout=3600.0, drain_timeout=0.0), 2, lambda n: "")
    s.begin(ask(3))
    assert not s.overdue()  # an hour to start
    s.finish()
    s.begin(ask(1))
    s.job.began = time.monotonic() - 1
    assert s.overdue()  # no time to drain


def test_memory_is_read_from_proc():
    import os

    assert free_memory_bytes() > 0
    assert tree_rss_bytes(os.getpid()) > 0
    assert tree_rss_bytes(2**22 + 12345) == 0  # no such process


@pytest.mark.parametrize("size", [0, -1])
def test_a_size_below_one_is_refused_here_too(size):
    """The API server refuses it first; the launcher does not trust that."""
    refused = scaler(size=2).refuse(ask(size))
    assert refused.status == 400 and "at least 1" in refused.error

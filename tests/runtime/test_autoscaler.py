"""The autoscaler's decisions (runtime/autoscaler.py) on a clock of its own: a backlog whose
mean over its window is high adds a rank, and so do ranks busy all along; ranks seldom busy
remove one (an idle stretch of one rank alone does not), the band between does nothing, and
the limits hold.
Served: tests/serve/test_elastic_dp.py."""

from __future__ import annotations

import pytest

from parashift.runtime.autoscaler import AutoscaleConfig, Autoscaler
from parashift.types.outputs import SchedulerStats
from parashift.wire import protocol as p

CONFIG = AutoscaleConfig(min_size=1, max_size=3, up_tokens=1000, up_window_s=10.0,
                         idle_window_s=60.0)


def loads(*ranks: tuple[int, int, int]) -> dict[int, p.EngineLoad]:
    """(waiting, running, prompt tokens waiting) per rank."""
    return {r: p.EngineLoad(r, SchedulerStats(w, n, 0.0, prefill_tokens_left=t))
            for r, (w, n, t) in enumerate(ranks)}


def test_a_backlog_that_lasts_its_window_adds_one_rank():
    a = Autoscaler(CONFIG)
    busy = loads((5, 4, 3000))
    assert a.decide(0.0, 1, busy) is None
    assert a.decide(9.9, 1, busy) is None  # not watched a whole window yet
    decision = a.decide(10.0, 1, busy)
    assert decision.size == 2 and "3000 prompt tokens waiting per rank" in decision.reason


def test_the_backlog_is_a_mean_over_its_window_not_a_run():
    """A backlog that dips between arrivals still adds a rank when its mean is high; a short
    burst in a calm window does not."""
    a = Autoscaler(CONFIG)
    for t in range(10):  # 3000 for 0.8 s of every second, 0 for 0.2 s: mean 2400
        assert a.decide(t, 1, loads((5, 4, 3000))) is None
        assert a.decide(t + 0.8, 1, loads((0, 4, 0))) is None
    decision = a.decide(10.0, 1, loads((5, 4, 3000)))
    assert decision.size == 2 and "2400 prompt tokens waiting per rank" in decision.reason
    b = Autoscaler(CONFIG)
    assert b.decide(0.0, 1, loads((0, 1, 0))) is None
    assert b.decide(9.0, 1, loads((9, 1, 9000))) is None
    assert b.decide(10.0, 1, loads((9, 1, 9000))) is None  # mean 900: a burst


def test_ranks_that_were_seldom_busy_remove_one():
    a = Autoscaler(CONFIG)
    two = loads((0, 2, 0), (0, 0, 0))  # one of two ranks busy: the other would be 100% busy
    assert a.decide(0.0, 2, two) is None
    assert a.decide(60.0, 2, two) is None
    calm = Autoscaler(CONFIG)
    for t in range(0, 61, 10):  # one rank busy 5 s of every 10: 50% on one rank
        calm.decide(t, 2, two)
        decision = calm.decide(t + 5, 2, loads((0, 0, 0), (0, 0, 0)))
    assert decision.size == 1 and "busy 50% of the time" in decision.reason


def test_an_idle_stretch_of_one_rank_is_not_enough():
    """Two ranks each busy most of the time, one of them idle for a whole window's start:
    what both carry would not fit one."""
    a = Autoscaler(CONFIG)
    assert a.decide(0.0, 2, loads((0, 3, 0), (0, 0, 0))) is None
    assert a.decide(20.0, 2, loads((0, 3, 0), (1, 1, 100))) is None
    assert a.decide(60.0, 2, loads((0, 3, 0), (1, 1, 100))) is None  # 1.67 ranks busy


def test_ranks_busy_all_along_add_one_though_little_waits():
    """A load just under what one rank does: it is never free, but little queues."""
    a = Autoscaler(CONFIG)
    for t in range(0, 60, 2):
        assert a.decide(t, 1, loads((1, 1, 500))) is None
        assert a.decide(t + 1, 1, loads((0, 1, 0))) is None
    decision = a.decide(60.0, 1, loads((0, 1, 0)))
    assert decision.size == 2 and "1.00 of 1 ranks busy" in decision.reason
    b = Autoscaler(CONFIG)  # free a tenth of the time: not saturated
    for t in range(0, 60, 10):
        b.decide(t, 1, loads((0, 1, 0)))
        assert b.decide(t + 9, 1, loads((0, 0, 0))) is None
    assert b.decide(60.0, 1, loads((0, 0, 0))) is None


def test_the_band_between_does_nothing():
    """The ranks are seldom busy, but the backlog per rank is between a quarter of the
    threshold and the threshold: neither way."""
    a = Autoscaler(CONFIG)
    band = loads((3, 0, 1200), (0, 0, 0))  # 600 per rank
    assert a.decide(0.0, 2, band) is None
    assert a.decide(1000.0, 2, band) is None


def test_the_limits_hold():
    a = Autoscaler(CONFIG)
    full = loads((9, 9, 9000), (9, 9, 9000), (9, 9, 9000))
    assert a.decide(0.0, 3, full) is None and a.decide(100.0, 3, full) is None  # max
    b = Autoscaler(CONFIG)
    assert b.decide(0.0, 1, {}) is None and b.decide(1000.0, 1, {}) is None  # min


def test_windows_restart_after_a_decision():
    a = Autoscaler(CONFIG)
    busy = loads((5, 4, 3000))
    a.decide(0.0, 1, busy)
    assert a.decide(10.0, 1, busy).size == 2
    a.restart_windows()
    assert a.decide(11.0, 2, loads((5, 4, 6000), (5, 4, 0))) is None  # new evidence first
    assert a.decide(21.0, 2, loads((5, 4, 6000), (5, 4, 0))).size == 3


def test_windows_of_zero_read_the_latest_sample():
    a = Autoscaler(AutoscaleConfig(1, 2, up_tokens=500, up_window_s=0, idle_window_s=0))
    assert a.decide(0.0, 1, loads((1, 0, 600))).size == 2
    a.restart_windows()
    assert a.decide(1.0, 2, loads((0, 1, 0), (0, 0, 0))) is None  # one busy: not 75% of one
    assert a.decide(2.0, 2, loads((0, 0, 0), (0, 0, 0))).size == 1


@pytest.mark.parametrize("bad", [dict(min_size=0, max_size=2), dict(min_size=3, max_size=2),
                                 dict(min_size=1, max_size=2, up_tokens=0),
                                 dict(min_size=1, max_size=2, up_window_s=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="--"):
        AutoscaleConfig(**bad)


@pytest.mark.parametrize("shares", [dict(down_busy=0.0), dict(up_busy=1.5),
                                    dict(down_busy=0.9, up_busy=0.8)])
def test_the_busy_shares_are_ordered_shares(shares):
    with pytest.raises(ValueError, match="down_busy < up_busy"):
        AutoscaleConfig(1, 2, **shares)

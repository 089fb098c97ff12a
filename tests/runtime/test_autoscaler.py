"""The autoscaler's decisions (runtime/autoscaler.py) on a clock of its own: a backlog that
lasts its window adds a rank, an idle rank past its window removes one, the band between does
nothing, and the limits hold. Served: tests/serve/test_elastic_dp.py."""

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
    assert a.decide(9.9, 1, busy) is None
    decision = a.decide(10.0, 1, busy)
    assert decision.size == 2 and "3000 prompt tokens waiting per rank" in decision.reason


def test_a_backlog_that_clears_starts_its_window_again():
    a = Autoscaler(CONFIG)
    assert a.decide(0.0, 1, loads((5, 4, 3000))) is None
    assert a.decide(5.0, 1, loads((0, 4, 0))) is None  # absorbed
    assert a.decide(12.0, 1, loads((5, 4, 3000))) is None  # a new window from 12
    assert a.decide(22.0, 1, loads((5, 4, 3000))).size == 2


def test_an_idle_rank_past_its_window_removes_one():
    a = Autoscaler(CONFIG)
    two = loads((0, 2, 0), (0, 0, 0))
    assert a.decide(0.0, 2, two) is None
    decision = a.decide(60.0, 2, two)
    assert decision.size == 1 and "dp1 held no request" in decision.reason


def test_the_band_between_does_nothing():
    """Some rank idles, but the backlog per rank is between a quarter of the threshold and
    the threshold: neither way."""
    a = Autoscaler(CONFIG)
    band = loads((3, 2, 1200), (0, 0, 0))  # 600 per rank
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


@pytest.mark.parametrize("bad", [dict(min_size=0, max_size=2), dict(min_size=3, max_size=2),
                                 dict(min_size=1, max_size=2, up_tokens=0),
                                 dict(min_size=1, max_size=2, up_window_s=-1)])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError, match="--"):
        AutoscaleConfig(**bad)

"""RestartPolicy on a clock the test moves: 1 s after the first death, doubling for each quick
death in a row up to the maximum, back to 1 s after a rank lived a while; nothing without
restart; each due rank returned once."""

from __future__ import annotations

from parashift.runtime.restart_policy import (
    FIRST_RESTART_DELAY_S,
    MAX_RESTART_DELAY_S,
    STABLE_AFTER_S,
    RestartPolicy,
)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_quick_deaths_double_the_delay_up_to_the_maximum():
    clock = Clock()
    policy = RestartPolicy(True, clock)
    delays = []
    for _ in range(8):
        policy.started(0)
        clock.now += 0.5  # dies quickly
        policy.died(0)
        delays.append(policy.delay[0])
        assert policy.due() == []  # not before its time
        clock.now += policy.delay[0]
        assert policy.due() == [0] and policy.due() == []
    assert delays[:4] == [FIRST_RESTART_DELAY_S * 2**i for i in range(4)]
    assert max(delays) == delays[-1] == MAX_RESTART_DELAY_S


def test_a_rank_that_lived_starts_from_the_first_delay_again():
    clock = Clock()
    policy = RestartPolicy(True, clock)
    for _ in range(3):
        policy.started(1)
        policy.died(1)
        clock.now += policy.delay[1]
        policy.due()
    assert policy.delay[1] == 4 * FIRST_RESTART_DELAY_S
    policy.started(1)
    clock.now += STABLE_AFTER_S + 1
    policy.died(1)
    assert policy.delay[1] == FIRST_RESTART_DELAY_S


def test_ranks_are_independent_and_nothing_restarts_when_off():
    clock = Clock()
    policy = RestartPolicy(True, clock)
    policy.started(0)
    policy.started(1)
    policy.died(0)
    policy.died(0)
    policy.died(1)
    clock.now += FIRST_RESTART_DELAY_S
    assert policy.due() == [1]
    clock.now += FIRST_RESTART_DELAY_S
    assert policy.due() == [0]
    off = RestartPolicy(False, clock)
    off.started(0)
    off.died(0)
    clock.now += MAX_RESTART_DELAY_S
    assert off.due() == [] and off.restart_at == {}

"""The lockstep wave state machine (engine/wave.py), simulated without torch: engines, the
coordinator's start-wave relay, and step collectives that complete only when every engine
has entered the same step. Under any interleaving of arrivals, aborts, message deliveries
and engine turns, no engine waits in a collective that another engine skipped, every request
finishes, the waves stop on every engine together, and each engine runs at most one dummy
step after the last request finished."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from parashift.engine.wave import WaveState


@dataclass
class SimEngine:
    wave: WaveState = field(default_factory=WaveState)
    requests: list[int] = field(default_factory=list)  # steps each still needs
    inbox: list[tuple[str, int]] = field(default_factory=list)  # ("request", n) | ("wave", w)
    step_index: int = 0  # steps run in the current wave
    waiting: tuple[int, int, bool] | None = None  # in a collective: (wave, step, had work)
    dummy_after_last: int = 0


class Sim:
    def __init__(self, num_engines: int):
        self.engines = [SimEngine() for _ in range(num_engines)]
        self.coordinator: list[int] = []  # StartWave calls not yet relayed
        self.requests_left = 0

    def arrive(self, rank: int, steps: int) -> None:
        self.engines[rank].inbox.append(("request", steps))
        self.requests_left += 1
        for engine in self.engines:  # count the dummy steps after the last request only
            engine.dummy_after_last = 0

    def abort(self, rank: int) -> None:
        engine = self.engines[rank]
        if engine.requests and engine.waiting is None:
            engine.requests.pop()
            self.requests_left -= 1

    def relay(self) -> None:
        if self.coordinator:
            wave = self.coordinator.pop(0)
            for engine in self.engines:
                engine.inbox.append(("wave", wave))

    def turn(self, rank: int) -> bool:
        """One pass of engine `rank`'s loop; False if it is blocked in a collective."""
        engine = self.engines[rank]
        if engine.waiting is not None:
            return False
        for kind, value in engine.inbox:
            if kind == "request":
                engine.requests.append(value)
            else:
                engine.wave.on_start_wave(value)
        engine.inbox.clear()
        wave = engine.wave.start_if_needed(bool(engine.requests))
        if wave is not None:
            self.coordinator.append(wave)
        if engine.wave.running:
            engine.waiting = (engine.wave.finished, engine.step_index, bool(engine.requests))
            self._complete_collective()
        return True

    def _complete_collective(self) -> None:
        keys = {e.waiting[:2] for e in self.engines if e.waiting is not None}
        assert len(keys) <= 1, f"engines wait in different collectives: {keys}"
        if any(e.waiting is None for e in self.engines):
            return
        group_has_work = any(e.waiting[2] for e in self.engines)
        all_done = self.requests_left == 0  # before this step: it is a dummy step after them
        for engine in self.engines:
            if engine.requests:
                engine.requests = [n - 1 for n in engine.requests]
                done = sum(1 for n in engine.requests if n == 0)
                self.requests_left -= done
                engine.requests = [n for n in engine.requests if n > 0]
            elif all_done:
                engine.dummy_after_last += 1
            engine.waiting = None
            engine.step_index += 1
            engine.wave.after_step(group_has_work)
            if not engine.wave.running:
                engine.step_index = 0

    def settle(self) -> None:
        for _ in range(10_000):
            self.relay()
            moved = [self.turn(r) for r in range(len(self.engines))]
            if (not any(moved) or not any(e.wave.running for e in self.engines)) and \
                    not self.coordinator and not any(e.inbox for e in self.engines):
                if not any(e.wave.running or e.requests for e in self.engines):
                    return
        raise AssertionError("the engines did not settle (a hang)")


waves_mid_script: list[int] = []


@settings(max_examples=300, deadline=None)
@given(num_engines=st.integers(2, 4), seed=st.integers(0, 2**32))
def test_no_interleaving_splits_a_collective_or_hangs(num_engines, seed):
    """300 random actions: arrivals and aborts, relays of start-wave calls, engine turns
    (drawn most often, so that many waves start and end before the final settling)."""
    sim, rng = Sim(num_engines), random.Random(seed)
    for _ in range(300):
        action, rank = rng.random(), rng.randrange(num_engines)
        if action < 0.1:
            sim.arrive(rank, rng.randrange(1, 6))
        elif action < 0.15:
            sim.abort(rank)
        elif action < 0.35:
            sim.relay()
        else:
            sim.turn(rank)
    waves_mid_script.append(sim.engines[0].wave.finished)
    sim.settle()
    assert sim.requests_left == 0
    assert len({e.wave.finished for e in sim.engines}) == 1  # every wave ended everywhere
    assert all(e.dummy_after_last <= 1 for e in sim.engines)


def test_the_scripts_ended_waves_before_settling():
    assert sum(waves_mid_script) > len(waves_mid_script)  # the property test ran first


def test_a_late_or_repeated_start_call_is_ignored():
    wave = WaveState()
    assert wave.start_if_needed(has_requests=True) == 0
    wave.after_step(group_has_work=False)
    assert (wave.running, wave.finished) == (False, 1)
    wave.on_start_wave(0)  # the relay of the call for the wave that just ended
    assert not wave.running
    wave.on_start_wave(1)
    assert wave.running and wave.start_if_needed(has_requests=True) is None

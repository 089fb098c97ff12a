"""One engine's side of the lockstep waves (expert parallel over engines), torch-free.

A wave is a run of steps that every engine of the group takes together, each step's
collectives (the expert dispatch) needing every engine. An engine with no requests in a wave
runs a dummy step. Every step's first collective also tells every engine whether any engine
had requests when it scheduled; a step where none had ends the wave on all engines at once,
so after the last request finishes each engine runs exactly one dummy step, then blocks.

Starting: an engine that has requests while its wave is over starts the next wave itself and
asks the coordinator to start it on the others (`StartWave(w)`, w = waves it has finished).
An engine joins wave w only while idle and after finishing exactly w waves, so a late or
repeated call never starts a wave twice, and every engine runs wave w's steps in the same
order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WaveState:
    finished: int = 0  # waves this engine has run to their end
    running: bool = False

    def start_if_needed(self, has_requests: bool) -> int | None:
        """Before a step: with requests and no wave, start one; returns the wave number to
        ask the coordinator for (None: nothing to ask)."""
        if self.running or not has_requests:
            return None
        self.running = True
        return self.finished

    def on_start_wave(self, wave: int) -> None:
        """The coordinator's call for wave `wave`: join it unless it is over or running."""
        if not self.running and wave >= self.finished:
            self.finished = wave
            self.running = True

    def after_step(self, group_has_work: bool) -> None:
        """After a step of the wave: it ends when no engine had requests."""
        if not group_has_work:
            self.running = False
            self.finished += 1

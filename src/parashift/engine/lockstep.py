"""Expert parallel over engines (lockstep): every engine of the group steps in waves
(engine/wave.py), a dummy step where it has nothing to schedule, so that the group's
collectives (the expert dispatch) always have it. The generic EngineCore and engine loop know
nothing of waves: this core subclass keeps their counters, and LockstepSteps is how the
engine process steps it."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from parashift.config import EngineConfig
from parashift.engine.core import EngineCore, make_executor
from parashift.engine.prefill_cadence import PrefillCadence
from parashift.engine.steps import Steps
from parashift.engine.wave import WaveState
from parashift.strategies.mesh import EnginePlacement
from parashift.types.outputs import EngineCoreOutput
from parashift.wire import protocol as p
from parashift.wire.lockstep_protocol import StartWave, WaveStats


class LockstepEngineCore(EngineCore):
    def __init__(self, config: EngineConfig, executor=None,
                 placement: EnginePlacement | None = None):
        self.wave_stats = WaveStats()
        self.cadence = PrefillCadence(config.scheduler.prefill_schedule_interval)
        super().__init__(config, executor or make_executor(config, placement, lockstep=True))

    def step_in_wave(self) -> tuple[list[EngineCoreOutput], bool]:
        """One step of the wave, and whether any engine of the group had work."""
        scheduler, cadence, stats = self.scheduler, self.cadence, self.wave_stats
        scheduler.admits_prefill = admitted = cadence.admits()
        scheduler_output = scheduler.schedule()
        cadence.scheduled(admitted, len(scheduler.waiting),
                          not admitted and scheduler.has_prefill_work())
        if scheduler_output.is_empty:
            stats.num_dummy_steps += 1
        start = time.perf_counter()
        step = self.executor.execute_wave_step(scheduler_output,
                                               scheduler.has_unfinished_requests,
                                               cadence.saturated)
        stats.step_seconds += time.perf_counter() - start
        stats.dispatch_seconds += step.dispatch_seconds
        stats.num_waves += 0 if step.group_has_work else 1
        stats.num_prefill_held_steps = cadence.num_held_steps
        if step.expert_tokens:
            stats.expert_tokens = ([a + b for a, b in zip(stats.expert_tokens,
                                                          step.expert_tokens, strict=True)]
                                   if stats.expert_tokens else step.expert_tokens)
        cadence.stepped(step.group_saturated, step.group_has_work)
        outputs = self.scheduler.update_from_output(scheduler_output, step.output)
        return outputs, step.group_has_work


class LockstepSteps(Steps):
    """The engine process's side: the coordinator's start-wave calls (`waves_in`), starting a
    wave when work comes while there is none (and asking the coordinator to start it on the
    others, through `load_out`), stepping with the group while the wave runs, and waking from
    a sleep when a peer's wave needs this rank."""

    def __init__(self, rank: int, core: LockstepEngineCore, load_out: zmq.Socket,
                 waves_in: zmq.Socket, publish: Callable[[list[EngineCoreOutput]], None]):
        super().__init__(core, publish)
        self.rank = rank
        self.load_out = load_out
        self.waves_in = waves_in
        self.wave = WaveState()

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests() or self.wave.running

    def sockets(self) -> list[zmq.Socket]:
        return [self.waves_in]

    def on_socket(self, sock: zmq.Socket) -> None:
        while True:
            try:
                msg = p.decode_or_drop(self.waves_in.recv(zmq.NOBLOCK), p.FromCoordinator,
                                       "waves")
            except zmq.Again:
                return
            if isinstance(msg, StartWave):
                self.wave.on_start_wave(msg.wave)

    def before_settle(self, sleep) -> None:
        if sleep.level and self.wave.running:  # a lockstep peer needs this rank
            sleep.wake_for_peer()

    def step(self) -> None:
        core = self.core
        wave = self.wave.start_if_needed(core.has_unfinished_requests())
        if wave is not None:
            self.load_out.send(p.encode(StartWave(wave, self.rank)))
        if not self.wave.running:
            core.executor.check_health()
            return
        outputs, group_has_work = core.step_in_wave()
        self.publish(outputs)
        self.wave.after_step(group_has_work)

    def extend_load(self, load: p.EngineLoad) -> tuple[int, bool]:
        """The wave counters go along when a wave starts or ends (not every dummy step): a
        report of no requests and no wave says the counters are final until the next one."""
        stats = self.core.wave_stats
        stats.in_wave = self.wave.running
        load.wave = stats
        return stats.num_waves, self.wave.running

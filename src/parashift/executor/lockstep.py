"""The executors of a lockstep engine (expert parallel over engines, engine/lockstep.py): the
generic ones, plus the wave step that only the lockstep engine core calls."""

from __future__ import annotations

from parashift.executor.local import LocalExecutor
from parashift.executor.lockstep_worker import LockstepWorker
from parashift.executor.multiproc import MultiprocExecutor
from parashift.types.outputs import SchedulerOutput
from parashift.wire.lockstep_protocol import ExecuteWaveStep, WaveStepOutput, WaveStepResult


class LockstepLocalExecutor(LocalExecutor):
    worker_base = LockstepWorker

    def execute_wave_step(self, scheduler_output: SchedulerOutput, has_work: bool,
                          saturated: bool = False) -> WaveStepOutput:
        return self._call(self.worker.execute_wave_step, scheduler_output, has_work, saturated)


class LockstepMultiprocExecutor(MultiprocExecutor):
    """Its workers are LockstepWorkers (executor/worker_process.py picks them by the
    strategy)."""

    def execute_wave_step(self, scheduler_output: SchedulerOutput, has_work: bool,
                          saturated: bool = False) -> WaveStepOutput:
        """One step of the wave on every worker (never in flight with others)."""
        self._broadcast(ExecuteWaveStep(scheduler_output, has_work, saturated))
        return self._collect(WaveStepResult, 1)[0].result

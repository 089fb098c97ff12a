"""A worker of a lockstep group (expert parallel over engines, engine/lockstep.py): every
engine's workers take every step of a wave together, with work or without, because each
MoE layer's expert dispatch needs every rank of the group."""

from __future__ import annotations

import torch

from parashift.executor.step_result import Sampled
from parashift.executor.worker import Worker
from parashift.types.outputs import ModelRunnerOutput, SchedulerOutput
from parashift.wire.lockstep_protocol import WaveStepOutput


class LockstepWorker(Worker):
    @torch.inference_mode()
    def execute_wave_step(self, scheduler_output: SchedulerOutput, has_work: bool,
                          saturated: bool = False) -> WaveStepOutput:
        """One step of the wave; `has_work`: whether this engine still has requests;
        `saturated`: whether its prefill cadence is (engine/prefill_cadence.py). The step's
        first collective tells every rank whether any engine had work, or was saturated."""
        runner, out = self.runner, scheduler_output
        dispatcher = runner.dispatcher
        runner.batch.apply(out)
        comm = dispatcher.ep.stats
        waited = comm.seconds
        group_has_work = dispatcher.begin_step(out.total_num_scheduled_tokens, has_work,
                                               saturated)
        output = ModelRunnerOutput({})
        if not out.is_empty:
            result = runner.run_applied(out)  # (one step at a time: never deferred)
            if isinstance(result, Sampled):
                output = result.host_output()
        elif dispatcher.max_tokens:  # a dummy step: our experts still serve the others' tokens
            runner.forward_no_tokens()
        return WaveStepOutput(output, group_has_work, comm.seconds - waited,
                              dispatcher.any_saturated, dispatcher.take_routed())

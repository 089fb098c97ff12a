"""The lockstep messages and counters (expert parallel over engines: engine/lockstep.py,
executor/lockstep.py). The generic messages (protocol.py, worker_protocol.py) carry these only
in their unions, and a load report its optional WaveStats.

  coordinator PULL <- engine PUSH: StartWave; coordinator PUB -> engine SUB: StartWave
  engine -> its workers: ExecuteWaveStep; the output rank answers WaveStepResult
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parashift.types.outputs import ModelRunnerOutput, SchedulerOutput
from parashift.wire.message import _Msg


@dataclass
class WaveStats:
    """Since the engine started: steps run with nothing to schedule, waves ended, and the
    seconds of all steps and of their expert dispatch / combine within them; and whether the
    engine is in a wave now."""

    num_dummy_steps: int = 0
    num_waves: int = 0
    step_seconds: float = 0.0
    dispatch_seconds: float = 0.0
    in_wave: bool = False
    num_prefill_held_steps: int = 0  # steps whose prefill work the cadence held back
    # The engine's own tokens routed to each expert (global ids), summed over the MoE layers
    expert_tokens: list[int] = field(default_factory=list)


@dataclass
class WaveStepOutput:
    """A lockstep step: the runner's output, whether any engine of the group had work (the
    step's first collective says), and the seconds of this step's expert dispatch and
    combine."""

    output: ModelRunnerOutput
    group_has_work: bool
    dispatch_seconds: float
    group_saturated: bool = False  # any engine's last admitting step left requests waiting
    expert_tokens: list[int] = field(default_factory=list)  # this step's (WaveStats')


class StartWave(_Msg):
    """An engine that got work while its wave was over asks the coordinator to start wave
    `wave` (its count of finished waves) on every engine; the coordinator publishes it on. An
    engine joins if it is idle and has finished exactly `wave` waves."""

    wave: int
    rank: int = -1  # who asked (-1: the coordinator)


class ExecuteWaveStep(_Msg):
    """One lockstep step: the step, whether this engine still has requests, and whether it is
    saturated (engine/prefill_cadence.py)."""

    scheduler_output: SchedulerOutput
    has_work: bool
    saturated: bool = False


class WaveStepResult(_Msg):
    result: WaveStepOutput

"""The messages between an engine core and its workers (tp/pp ranks; msgpack like every
message, wire/protocol.py):

  engine PUSH (one per worker) -> worker PULL: ExecuteModel (ExecuteWaveStep in lockstep;
  SampleTokens after a deferred mask), WorkerCall;
  worker PUSH -> engine PULL: WorkerReady, WorkerReply; only the output rank (last pp stage,
  tp rank 0) answers ExecuteModel (StepResult), every rank answers a WorkerCall.
"""

from __future__ import annotations

from typing import Any

from parashift.types.outputs import (
    GrammarBitmask,
    ModelRunnerOutput,
    SchedulerOutput,
    WaveStepOutput,
)
from parashift.wire.protocol import _Msg


class ExecuteModel(_Msg):
    """One step: only what changed since the last one (the runner keeps the rest)."""

    scheduler_output: SchedulerOutput


class SampleTokens(_Msg):
    """The mask of the last step submitted with a deferred one (async scheduling with
    structured outputs): its sampling goes on."""

    grammar: GrammarBitmask | None


class ExecuteWaveStep(_Msg):
    """One lockstep step (expert parallel over engines): the step, and whether this engine
    still has requests."""

    scheduler_output: SchedulerOutput
    has_work: bool


class WorkerCall(_Msg):
    method: str  # "determine_num_blocks" | "kv_block_bytes" | "initialize_cache" | "stop"
    args: list[Any] = []


class WorkerReady(_Msg):
    rank: int


class StepResult(_Msg):
    output: ModelRunnerOutput


class WaveStepResult(_Msg):
    result: WaveStepOutput


class WorkerReply(_Msg):
    rank: int
    result: Any = None
    error: str | None = None


ToWorker = ExecuteModel | SampleTokens | ExecuteWaveStep | WorkerCall
FromWorker = WorkerReady | StepResult | WaveStepResult | WorkerReply

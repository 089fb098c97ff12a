"""The messages between an engine core and its workers (tp/pp ranks; msgpack like every
message, wire/protocol.py):

  engine PUSH (one per worker) -> worker PULL: ExecuteModel (ExecuteWaveStep in lockstep:
  lockstep_protocol.py; SampleTokens after a deferred mask), WorkerCall;
  worker PUSH -> engine PULL: WorkerReady, WorkerReply; only the output rank (last pp stage,
  tp rank 0) answers ExecuteModel (StepResult), every rank answers a WorkerCall.

A WorkerCall's args and a WorkerReply's result are typed Any: a worker extension's methods
(`--worker-extension-cls`) take and give what they like, as vLLM's collective_rpc does. Their
depth is bounded by the interpreter's recursion limit (msgspec raises RecursionError past it,
and `protocol.decode_or_drop` drops the frame), and only the engine and its own workers hold
these links (ipc in the launch's folder; over tcp, each worker's own key: cluster_auth.py
WorkerKeys).
"""

from __future__ import annotations

from typing import Any

from parashift.types.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from parashift.wire.lockstep_protocol import ExecuteWaveStep, WaveStepResult
from parashift.wire.message import _Msg


class ExecuteModel(_Msg):
    """One step: only what changed since the last one (the runner keeps the rest)."""

    scheduler_output: SchedulerOutput


class SampleTokens(_Msg):
    """The mask of the last step submitted with a deferred one (async scheduling with
    structured outputs): its sampling goes on."""

    grammar: GrammarBitmask | None


class WorkerCall(_Msg):
    method: str  # "determine_num_blocks" | "kv_block_bytes" | "initialize_cache" | "stop"
    args: list[Any] = []


class WorkerReady(_Msg):
    rank: int


class StepResult(_Msg):
    output: ModelRunnerOutput


class WorkerReply(_Msg):
    rank: int
    result: Any = None
    error: str | None = None


ToWorker = ExecuteModel | SampleTokens | ExecuteWaveStep | WorkerCall
FromWorker = WorkerReady | StepResult | WaveStepResult | WorkerReply

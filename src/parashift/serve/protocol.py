"""Every message that crosses a process boundary, as msgspec structs (msgpack on the wire,
never pickle). Sockets (see DESIGN.md, "Processes and sockets"):

  handshake   launcher ROUTER  <- engine DEALER (identity = rank): Hello -> EngineInit -> Ready
  requests    API server ROUTER <- engine DEALER (identity = rank): AddRequest, AbortRequests,
              UtilityCall down; EngineReady up. The launcher's DEALER (identity b"launcher")
              sends EngineDead / Shutdown on the same socket and gets ApiServerReady back.
  outputs     API server PULL   <- engine PUSH: EngineOutputs, UtilityResult, EngineDead
  load        coordinator PULL  <- engine PUSH: EngineLoad;
              coordinator PUB   -> API server SUB: LoadVector (dp > 1 only)
"""

from __future__ import annotations

from typing import Any

import msgspec

from parashift.engine.outputs import EngineCoreOutput, SchedulerStats
from parashift.engine.sampling_params import SamplingParams


class _Msg(msgspec.Struct, array_like=True, gc=False, omit_defaults=True, tag=True):
    pass


# --- handshake -------------------------------------------------------------------------------
class Hello(_Msg):
    rank: int
    pid: int


class EngineInit(_Msg):
    """Everything an engine needs to join: its engine arguments and every API server's
    request (ROUTER) and output (PULL) addresses."""

    engine_args: dict[str, Any]
    request_addresses: list[str]
    output_addresses: list[str]
    num_threads: int | None = None
    cpu_ids: list[int] = []  # CPU cores this rank may use (empty: no pinning)
    coordinator_address: str | None = None  # where to push load (dp > 1)


class Ready(_Msg):
    rank: int
    num_blocks: int
    block_size: int
    max_model_len: int


class StartupFailed(_Msg):
    rank: int
    error: str


# --- API server -> engine --------------------------------------------------------------------
class AddRequest(_Msg):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    client_index: int  # which API server receives the outputs
    arrival_time: float


class AbortRequests(_Msg):
    request_ids: list[str]


class UtilityCall(_Msg):
    call_id: int
    method: str  # "reset_prefix_cache" | "stats"
    client_index: int


# --- engine -> API server --------------------------------------------------------------------
class EngineReady(_Msg):
    rank: int
    max_model_len: int
    num_blocks: int


class EngineOutputs(_Msg):
    """One engine step's outputs for the requests one API server owns, plus the engine's load."""

    rank: int
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class UtilityResult(_Msg):
    rank: int
    call_id: int
    result: Any = None
    error: str | None = None


class EngineDead(_Msg):
    """An engine failed (sent by the engine itself, or by the launcher that saw it die)."""

    rank: int
    reason: str


class ApiServerReady(_Msg):
    """API server -> launcher: every engine has joined; it can serve."""

    index: int


class EngineLoad(_Msg):
    """Engine -> coordinator whenever its load changes."""

    rank: int
    num_waiting: int
    num_running: int
    kv_cache_usage: float


class LoadVector(_Msg):
    """Coordinator -> every API server: all ranks' load (at most every 100 ms)."""

    seq: int
    loads: list[EngineLoad]


class Shutdown(_Msg):
    """Launcher -> API server: stop accepting, drain within the timeout, exit."""

    timeout_s: float


ToEngine = AddRequest | AbortRequests | UtilityCall  # on an engine's request sockets
Handshake = Hello | Ready | StartupFailed  # what the launcher receives
Outputs = EngineOutputs | UtilityResult | EngineDead  # on an API server's PULL socket
Control = EngineReady | EngineDead | Shutdown  # on an API server's ROUTER socket

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, kind: Any) -> Any:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return decoder.decode(data)

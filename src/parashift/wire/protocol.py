"""Every message between the launch's processes, as msgspec structs (msgpack on the wire,
never pickle; an engine's to its own workers: worker_protocol.py; an API server's calls on an
engine: engine_calls.py; lockstep's: lockstep_protocol.py). Sockets (docs/architecture.md):

  handshake   launcher ROUTER  <- engine DEALER: Hello -> EngineInit -> Ready
  requests    API server ROUTER <- engine DEALER: AddRequest, AbortRequests, engine calls down;
              EngineReady up (the API server routes to the identity it came from). The
              launcher's DEALER sends EngineDead / Shutdown on the same socket and gets
              ApiServerReady back.
  outputs     API server PULL   <- engine PUSH: EngineOutputs, RequestFailed, UtilityResult,
              EngineDead
  load        coordinator PULL  <- engine PUSH: EngineLoad on change, Heartbeat every second,
              StartWave (lockstep);
              coordinator PUB   -> API server SUB: LoadVector, EngineDead (a silent rank);
              -> engine SUB (lockstep only): StartWave
  workers     an engine and its workers: wire/worker_protocol.py
  nodes       head launcher ROUTER (the handshake socket) <- headless launcher DEALER
              NodeHello -> NodeInit (or NodeRefused, why); EngineDead up; Shutdown,
              RetireRanks down.

Every identity on a ROUTER is unguessable and new in each process (`sockets.routing_id`), and
no ROUTER hands one over. Over CURVE, what speaks for a rank counts only from the link of that
rank's key (`cluster_auth.py`).

An engine's `incarnation` (its pid) tells a restarted rank from the one that died: a late
EngineDead about an earlier incarnation never takes a revived rank down again.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from parashift.types.outputs import EngineCoreOutput, SchedulerStats
from parashift.types.sampling_params import SamplingParams
from parashift.wire.engine_calls import GetStats, IsSleeping, ResetPrefixCache, Sleep, WakeUp
from parashift.wire.engine_config import EngineConfigWire
from parashift.wire.lockstep_protocol import StartWave, WaveStats
from parashift.wire.message import _Msg


# --- handshake -------------------------------------------------------------------------------
class Hello(_Msg):
    rank: int
    pid: int
    # What the head gave the engines it starts itself (its own node's, or Ray's): a Hello as
    # one of those ranks counts only with it.
    token: bytes = b""


class EngineInit(_Msg):
    """Everything an engine needs to join: the config the launcher resolved, for this rank
    (strategy with its plugin axes, and, for expert parallel over engines, where this
    incarnation of the group meets), and every API server's request (ROUTER) and output
    (PULL) addresses."""

    config: EngineConfigWire
    request_addresses: list[str]
    output_addresses: list[str]
    coordinator_address: str | None = None  # where to push load and heartbeats (dp > 1)
    # Lockstep (expert parallel over engines): the coordinator's PUB, for its start-wave calls.
    coordinator_publish_address: str | None = None
    # Over CURVE links: this rank's key pair (z85 public, secret) for every link but the
    # handshake; the head's processes take what speaks for the rank only from that key.
    rank_key: tuple[bytes, bytes] | None = None
    # Prefill/decode pools over nodes: the head's KV server, where a decode rank on another
    # node fetches a prompt's blocks from the head node's host tier (runtime/kv_server.py).
    kv_server: str | None = None


class Ready(_Msg):
    rank: int
    num_blocks: int
    block_size: int
    max_model_len: int
    weight_bytes: list[int] = []  # per worker, in mesh order (what `plan` predicts)


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
    # Prefill/decode pools (serve/handoff.py): a prefill rank's request stops after its first
    # token and stores its prompt's KV for a decode rank; a decode rank's continues the
    # tokens the prefill rank generated.
    hand_off: bool = False
    generated_token_ids: list[int] = []


class AbortRequests(_Msg):
    request_ids: list[str]


# --- engine -> API server --------------------------------------------------------------------
class EngineReady(_Msg):
    rank: int
    max_model_len: int
    num_blocks: int
    incarnation: int = 0
    block_size: int = 16  # the API servers' prefix routing hashes blocks of this size
    lockstep: bool = False  # expert parallel over engines: this rank dies with any peer
    # The host KV tier it shares with the ranks that name the same one (its node's), and how
    # many blocks that holds: the router counts a block there as cached on each of them.
    kv_tier: str | None = None
    kv_tier_blocks: int = 0


class EngineOutputs(_Msg):
    """One engine step's outputs for the requests one API server owns, plus the engine's load."""

    rank: int
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats


class RequestFailed(_Msg):
    """The engine refused one request (it never ran); the engine itself is fine."""

    rank: int
    request_id: str
    error: str
    status: int = 400  # the HTTP status it becomes: 400 bad request, 429 queue full


class UtilityResult(_Msg):
    """An engine call's answer: a reset's bool, a sleep state's or the stats' fields. No
    field typed Any: a nested frame cannot make a reader recurse."""

    rank: int
    call_id: int
    # (a stats field may be a nested record of numbers: SchedulerStats.kv_tiers)
    result: bool | int | float | dict[str, int | float | dict[str, int | float] | None] | None = (
        None)
    error: str | None = None


class EngineDead(_Msg):
    """An engine failed (sent by the engine itself, or by the launcher that saw it die)."""

    rank: int
    reason: str
    incarnation: int = 0  # 0: whichever incarnation is current


class ApiServerReady(_Msg):
    """API server -> launcher: every engine has joined; it can serve."""

    index: int


# --- elastic data parallel (runtime/scale.py) -------------------------------------------------
class ScaleRequest(_Msg):
    """API server -> launcher: POST /scale; the answer is a ScaleResult with the same id."""

    index: int  # the API server's
    call_id: int
    size: int  # the data-parallel size asked for


class ScaleResult(_Msg):
    """Launcher -> the API server that asked: the size that serves now; `error` (with its
    HTTP status) when the scale was refused or failed."""

    call_id: int
    size: int
    error: str = ""
    status: int = 200


class RankDraining(_Msg):
    """Launcher -> API servers: route nothing more to `rank`; move its unstarted requests."""

    rank: int


class RankRemoved(_Msg):
    """Launcher -> API servers: `rank` left the deployment (a scale-down); what it still held
    moves or ends with `reason`. Each answers RankRemovedSeen before the engine is stopped,
    so that the engine's own word of its stop never comes first."""

    rank: int
    reason: str


class RankRemovedSeen(_Msg):
    """API server -> launcher: it has let `rank` go."""

    index: int
    rank: int


class EngineLoad(_Msg):
    """Engine -> coordinator whenever its load changes. Every API server hears it through the
    coordinator, not only the one that was called: its router forgets the rank's blocks when
    the prefix cache's reset count moves; its /metrics show the load, the sleep and, in
    lockstep, the waves."""

    rank: int
    stats: SchedulerStats
    wave: WaveStats | None = None  # lockstep only
    sleep_level: int = 0
    sleep_released_bytes: int = 0
    # AddRequests this incarnation has taken from each API server (by index): the stats
    # include them, so each server counts on top only what it sent since.
    received: list[int] = msgspec.field(default_factory=list)


class Heartbeat(_Msg):
    """Engine -> coordinator every second, from a thread: this rank is alive even while a long
    step runs. A rank silent for --heartbeat-timeout is declared dead (it may be remote); one
    that stops cleanly says so last (`leaving`), so that its silence is no death."""

    rank: int
    incarnation: int
    leaving: bool = False


class LoadVector(_Msg):
    """Coordinator -> every API server: all ranks' load (at most every 100 ms)."""

    seq: int
    loads: list[EngineLoad]


class Shutdown(_Msg):
    """Launcher -> API server: stop accepting, drain within the timeout, exit.
    Head launcher -> headless launcher: stop your engines, exit."""

    timeout_s: float


# --- nodes -----------------------------------------------------------------------------------
class NodeHello(_Msg):
    """Headless launcher -> head launcher: I run ranks start_rank .. start_rank + size - 1."""

    start_rank: int
    size: int


class NodeInit(_Msg):
    """Head -> headless launcher: the coordinator's publisher, whose heartbeats say the head
    is alive, and the config the head resolved, as the node's first rank gets it: the node
    checks its flags, devices, memory and model files against it and never resolves its own
    (its engines get the same in their EngineInit)."""

    coordinator_publish_address: str
    # None only in the launcher's template: the handshake fills it in for each node.
    config: EngineConfigWire | None = None


class NodeRefused(_Msg):
    """Head -> headless launcher: this node's ranks are not taken, and why (they are out of
    the launch, the head runs them, another node's engines run them, or a joining node must
    take the ranks from the current size); the node stops with the reason."""

    reason: str


class RetireRanks(_Msg):
    """Head -> headless launcher: a scale-down removed these of its ranks (drained already):
    stop their engines, report no death; with none left, the node exits."""

    ranks: list[int]


class StopGroup(_Msg):
    """Head -> headless launcher: a rank of the expert-parallel lockstep group died or hung:
    stop these engines of the group's broken incarnation now, (rank, pid) as their Hellos
    said (an engine restarted since is not one of them), SIGKILL for the ranks in `kill`
    (hung), so that none waits in a collective on the dead one; their deaths are reported,
    and they restart as any death."""

    engines: list[tuple[int, int]]
    kill: list[int] = msgspec.field(default_factory=list)


# --- KV blocks between nodes (prefill/decode pools) -------------------------------------------
class KVFetch(_Msg):
    """Decode rank -> the head's KV server: the blocks of these tier keys, from the first."""

    fetch_id: int
    keys: list[int]


class KVBlocks(_Msg):
    """The KV server's answer: the run of the keys it holds from the first, `num_blocks` of
    them, each a frame of slot bytes after this one."""

    fetch_id: int
    num_blocks: int


# on an engine's request sockets
ToEngine = AddRequest | AbortRequests | Sleep | WakeUp | IsSleeping | ResetPrefixCache | GetStats
Handshake = Hello | Ready | StartupFailed | NodeHello | EngineDead  # to the head launcher
ToNode = NodeInit | NodeRefused | Shutdown | RetireRanks | StopGroup  # head -> headless
ToEngineLoad = EngineLoad | Heartbeat | StartWave  # on the coordinator's PULL socket
FromCoordinator = LoadVector | EngineDead | StartWave  # on API servers' and engines' SUB
# on an API server's PULL socket
Outputs = EngineOutputs | RequestFailed | UtilityResult | EngineDead
# on an API server's ROUTER socket
Control = EngineReady | EngineDead | Shutdown | ScaleResult | RankDraining | RankRemoved
# on the launcher's control sockets
FromApiServer = ApiServerReady | ScaleRequest | RankRemovedSeen

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, kind: Any) -> Any:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    return decoder.decode(data)


_num_dropped: dict[tuple[str, str], int] = {}
_logger = logging.getLogger(__name__)


def decode_or_drop(data: bytes, kind: Any, link: str) -> Any:
    """`decode`, or None for a frame that does not decode as `kind` (garbage, a foreign
    message): dropped and logged (the first on each link, then every 1,000th), never raised,
    so that no frame can stop the process that reads it. A value nested deeper than the
    interpreter's recursion limit (in a field typed Any, or a config's dict) is such a frame:
    msgspec raises RecursionError for it, and so may a struct's __post_init__."""
    try:
        return decode(data, kind)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        log_dropped(link, "a malformed frame", str(e))
        return None


def log_dropped(link: str, what: str, detail: str = "") -> None:
    """A frame read and dropped on `link`: logged the first time, then every 1,000th (a peer
    sending junk in a loop cannot flood the log)."""
    count = _num_dropped[link, what] = _num_dropped.get((link, what), 0) + 1
    if count % 1000 == 1:
        _logger.warning("dropped %s on the %s link (%d so far)%s", what, link, count,
                        f": {detail}" if detail else "")

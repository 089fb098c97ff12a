"""Each API server's client of the engines: it owns the ZMQ sockets to every engine (no
process between them: one hop less, no single point of failure), picks the engine for a
request, and fans each engine's outputs back to each request's sink (what is in flight:
serve/in_flight.py). What can go wrong with a request on the way is one of
serve/engine_errors.py's errors."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Collection, Sequence
from typing import Any

import zmq
import zmq.asyncio

from parashift.serve.engine_errors import (
    EngineUnavailableError,
    RequestFailedError,
)
from parashift.serve.engine_loads import EngineLoads
from parashift.serve.engine_ranks import EngineRanks
from parashift.serve.handoff import DecodePhase, EnginePools, Handoff
from parashift.serve.in_flight import InFlight, Sink
from parashift.serve.prefix_router import Router, RoutingConfig, prompt_hashes
from parashift.serve.rank_changes import RankChanges
from parashift.types.outputs import EngineCoreOutput, SchedulerStats
from parashift.types.sampling_params import SamplingParams
from parashift.wire import protocol as p
from parashift.wire.cluster_auth import HEAD, HeadKeys, rank_principal, speaks_for
from parashift.wire.engine_calls import EngineCall
from parashift.wire.sockets import bind, send_now, subscriber, zmq_context

logger = logging.getLogger(__name__)

class EngineClient(RankChanges):
    def __init__(self, client_index: int, request_address: str, output_address: str,
                 num_engines: int, coordinator_address: str | None = None,
                 bound: dict[str, socket.socket] | None = None,
                 routing: RoutingConfig | None = None, head_keys: HeadKeys | None = None,
                 launcher: bytes = b"launcher", size: int | None = None,
                 pools: EnginePools | None = None):
        """`num_engines`: the ranks there may be (up to --data-parallel-size-max), of which
        the first `size` are launched (all by default); `bound`: listening sockets the
        launcher bound at our tcp addresses; `head_keys`: over CURVE, the only keys our
        sockets accept (the head's and the ranks'), and what speaks for a rank counts only
        from its key; `launcher`: the launcher's identity; `pools`: prefill/decode pools,
        each request routed in two phases (serve/handoff.py)."""
        self.client_index = client_index
        self.num_engines = num_engines
        self.pools = pools
        self.launcher = launcher
        self.ctx = zmq_context(asyncio=True, role=head_keys.role() if head_keys else None)
        self.requests = self.ctx.socket(zmq.ROUTER)
        self.requests.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown engine raises, not drops
        self.requests.setsockopt(zmq.SNDHWM, 0)
        self.requests.setsockopt(zmq.RCVHWM, 0)
        self.requests.setsockopt(zmq.LINGER, 0)
        bind(self.requests, request_address, bound)
        self.outputs = self.ctx.socket(zmq.PULL)
        self.outputs.setsockopt(zmq.RCVHWM, 0)
        self.outputs.setsockopt(zmq.LINGER, 0)
        bind(self.outputs, output_address, bound)
        self.routes: dict[int, bytes] = {}  # rank -> its engine's identity on `requests`
        self.ranks = EngineRanks(num_engines, size)  # each rank's state (serve/engine_ranks.py)
        self._scales: dict[int, asyncio.Future] = {}  # ScaleRequest id -> its ScaleResult
        self._rank_news = asyncio.Event()  # a rank became ready
        self._scale_ids = itertools.count()
        self.stats: dict[int, SchedulerStats] = {}
        routing = routing or RoutingConfig()
        self.loads = EngineLoads(routing.by_tokens, client_index)
        self.in_flight = InFlight(self.loads)
        self.on_load = None  # optional hook(LoadVector) for metrics
        self.load_in = None
        if coordinator_address is not None:
            self.load_in = subscriber(self.ctx, coordinator_address)
        # Set once every engine has been ready: the API server accepts connections from then on.
        self.all_ready = asyncio.Event()
        self.shutdown_requested = asyncio.Event()
        self.shutdown_timeout = 0.0
        self.router = Router(routing, num_engines)
        self.block_size = 16  # the engines' (every EngineReady says it)
        self._tasks: list[asyncio.Task] = []
        self.on_outputs = None  # optional hook(rank, EngineOutputs) for metrics

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._recv_outputs(), name="outputs"),
                       asyncio.create_task(self._recv_control(), name="control")]
        if self.load_in is not None:
            self._tasks.append(asyncio.create_task(self._recv_load(), name="coordinator"))
        for task in self._tasks:
            task.add_done_callback(_log_failure)

    @property
    def sinks(self) -> dict[str, Sink]:  # request id -> where its outputs go
        return self.in_flight.sinks

    @property
    def engine_of(self) -> dict[str, int]:
        return self.in_flight.engine_of

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.ctx.destroy(linger=0)

    # --- health and routing ------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        stopped = [t.get_name() for t in self._tasks if t.done() and not t.cancelled()]
        if stopped:  # a bug the guarded receives did not catch: say so rather than hang
            return False, f"the API server's receive task(s) {', '.join(stopped)} stopped"
        if dead := self.ranks.dead():
            # The state, never the reason: an engine's reason is the last line of its
            # traceback, which may quote a request (the log has it: _mark_dead).
            return False, "; ".join(f"engine dp{r} is down (the server's log says why)"
                                    for r in sorted(dead))
        if missing := self.ranks.starting():
            return False, f"engine(s) {', '.join(f'dp{r}' for r in missing)} not ready yet"
        return True, "ok"

    def alive_engines(self) -> list[int]:
        return self.ranks.serving()

    @property
    def routes_by_prefix(self) -> bool:
        return self.router.config.policy == "prefix" and self.num_engines > 1

    def route_hashes(self, prompts: list[list[int]], salt: str | None) -> list[list[int]]:
        """What pick_engine routes by when `routes_by_prefix`: each prompt's block hashes, with
        the request's cache_salt as the engine hashes them. Linear in the prompts: the API
        server computes them off the event loop."""
        return prompt_hashes(prompts, self.block_size, salt)

    def pick_engine(self, pinned: int | None = None, exclude: int | Collection[int] = (),
                    hashes: Sequence[Sequence[int]] = ()) -> int:
        """A pinned rank, or the router's choice for the request's first prompt (its
        `route_hashes`) among the live ranks not in `exclude` (one that died, those whose
        queues refused it); the blocks of all its prompts are then recorded as living there."""
        excluded = {exclude} if isinstance(exclude, int) else set(exclude)
        alive = [r for r in self.alive_engines() if r not in excluded]
        if self.pools is not None and pinned is None:
            alive = self.pools.choose("prefill", alive)
        if pinned is not None:
            if pinned not in alive:
                raise EngineUnavailableError(f"engine dp{pinned} is not available")
            rank = pinned
        elif not alive:
            raise EngineUnavailableError(self.health()[1])
        else:
            rank = self.router.choose(alive, hashes[0] if hashes else [], self.loads.score)
        for blocks in hashes:
            self.router.record(rank, blocks)
        return rank

    async def _recv_load(self) -> None:
        while True:
            vector = p.decode_or_drop(await self.load_in.recv(), p.FromCoordinator,
                                      "coordinator")
            if vector is None:
                continue
            if isinstance(vector, p.EngineDead):  # a rank stopped sending heartbeats
                self.mark_dead(vector.rank, vector.reason, vector.incarnation)
                continue
            if isinstance(vector, p.StartWave):  # for the engines
                continue
            self.take_load(vector)

    def take_load(self, vector: p.LoadVector) -> None:
        """Every rank's load, from the coordinator. A rank whose prefix cache was emptied
        since the last vector loses its blocks in this server's router too."""
        for rank in self.loads.take(vector):
            self.router.forget(rank)
        if self.on_load is not None:
            self.on_load(vector)

    # --- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_id: int | None, rank: int,
                    sink: Sink, whole: bool = False) -> None:
        """`whole`: `rank` serves all of it (a pinned request), in a pool or not."""
        msg = p.AddRequest(request_id, prompt_token_ids, params, eos_token_id,
                           self.client_index, time.monotonic())
        if self.pools is not None and self.pools.of(rank) == "prefill" and not whole:
            msg.hand_off = True
            sink = Handoff(sink, DecodePhase(msg, self))
        self.send_request(rank, msg, sink)

    def send_request(self, rank: int, msg: p.AddRequest, sink: Sink) -> None:
        self._send_to(rank, msg)
        tokens = request_tokens(msg.prompt_token_ids, msg.params)
        self.in_flight.add(msg.request_id, rank, sink, tokens)
        self.loads.sent(rank, tokens)

    def abort(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for req_id in request_ids:
            rank = self.in_flight.forget(req_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(req_id)
        for rank, ids in by_rank.items():
            if self.ranks.is_dead(rank):
                continue
            try:
                self._send_to(rank, p.AbortRequests(ids))
            except EngineUnavailableError:
                logger.warning("could not send an abort to engine dp%d", rank)

    def _send_to(self, rank: int, msg: p.ToEngine) -> None:
        route = self.routes.get(rank)
        try:
            if route is None:
                raise zmq.ZMQError(zmq.EHOSTUNREACH)
            send_now(self.requests, [route, p.encode(msg)])
        except zmq.ZMQError as e:
            raise EngineUnavailableError(f"engine dp{rank} is unreachable ({e})") from e

    async def call(self, rank: int, kind: type[EngineCall], *args: Any) -> Any:
        """`kind(call_id, client_index, *args)` on engine `rank` (wire/engine_calls.py); its
        answer. A refusal raises RuntimeError with the engine's words."""
        call_id, future = self.in_flight.new_call(rank)
        try:
            self._send_to(rank, kind(call_id, self.client_index, *args))
        except EngineUnavailableError:
            self.in_flight.calls.pop(call_id)
            raise
        return await future

    # --- receiving ---------------------------------------------------------------------------
    async def _recv_outputs(self) -> None:
        while True:
            frame = await self.outputs.recv(copy=False)
            msg = p.decode_or_drop(frame.buffer, p.Outputs, "outputs")
            if msg is None or not speaks_for(frame, rank_principal(msg.rank), "outputs"):
                continue
            if isinstance(msg, p.EngineOutputs):
                self.stats[msg.rank] = msg.stats
                for out in msg.outputs:
                    if self.engine_of.get(out.request_id) == msg.rank:  # its own requests only
                        self._deliver(out)
                if self.on_outputs is not None:
                    self.on_outputs(msg)
            elif isinstance(msg, p.UtilityResult):
                self.in_flight.answer(msg)
            elif isinstance(msg, p.RequestFailed):
                self.in_flight.fail(msg.request_id, msg.rank,
                                    RequestFailedError(msg.error, msg.status))
            elif isinstance(msg, p.EngineDead):
                self.mark_dead(msg.rank, msg.reason, msg.incarnation)

    def _deliver(self, out: EngineCoreOutput) -> None:
        self.in_flight.deliver(out)

    async def _recv_control(self) -> None:
        while True:
            frames = await self.requests.recv_multipart(copy=False)
            msg = (p.decode_or_drop(frames[1].buffer, p.Control, "control")
                   if len(frames) == 2 else None)
            if isinstance(msg, p.EngineReady):
                if speaks_for(frames[1], rank_principal(msg.rank), "control"):
                    self.on_ready(msg, frames[0].bytes)
                    if not self.ranks.starting():
                        self.all_ready.set()
            elif msg is None or not speaks_for(frames[1], HEAD, "control"):
                continue  # the rest is the launcher's to say
            elif isinstance(msg, p.EngineDead):
                self.mark_dead(msg.rank, msg.reason, msg.incarnation)
            elif isinstance(msg, p.RankDraining):
                self.drain_rank(msg.rank)
            elif isinstance(msg, p.RankRemoved):
                self.remove_rank(msg.rank, msg.reason)
            elif isinstance(msg, p.ScaleResult):
                future = self._scales.pop(msg.call_id, None)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, p.Shutdown):
                self.shutdown_timeout = msg.timeout_s
                self.shutdown_requested.set()

    async def tell_launcher_ready(self) -> None:
        # The launcher's connection may still be completing its handshake: retry briefly.
        msg = [self.launcher, p.encode(p.ApiServerReady(self.client_index))]
        for _ in range(200):
            try:
                send_now(self.requests, msg)
                return
            except zmq.ZMQError:
                await asyncio.sleep(0.05)
        logger.error("could not tell the launcher that this API server is ready")


def request_tokens(prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
    """One engine request's token load: its prompt and the output tokens it may make."""
    return len(prompt_token_ids) + (params.max_tokens or 0)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("broker task failed", exc_info=task.exception())

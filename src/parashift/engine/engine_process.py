"""The engine-core process: handshake with the launcher, then a busy loop of
input sockets -> scheduler step -> outputs, blocking on its sockets when there is no work."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from parashift.engine.args import config_for_this_node
from parashift.engine.core import EngineCore
from parashift.engine.heartbeat import Heartbeat
from parashift.engine.lockstep import LockstepEngineCore, LockstepSteps
from parashift.engine.request import Request
from parashift.engine.scheduler import QueueFullError
from parashift.engine.sleep_state import ASLEEP_MESSAGE, SleepState
from parashift.engine.steps import Steps
from parashift.processes import (
    die_with_parent,
    keep_temp_files_in_launch_folder,
    set_process_name,
    setup_child_logging,
)
from parashift.strategies.mesh import EnginePlacement, engine_process_name
from parashift.types.outputs import EngineCoreOutput
from parashift.wire import engine_calls as calls
from parashift.wire import protocol as p
from parashift.wire.cluster_auth import CurvePair, Role
from parashift.wire.sockets import routing_id, subscriber, zmq_context

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # blocking poll; wakes only to notice a shutdown signal (soon)
# An unanswered Hello is said again this often: the head answers a rank's next engine only
# once it knows the last one died, and a headless node's report of that death may reach it
# after the restarted engine's first Hello.
HELLO_RETRY_S = 1.0
LOAD_TOKENS_INTERVAL_S = 0.02  # token load reports between count changes, at most this often


def say_hello(sock: zmq.Socket, hello: p.Hello, timeout: float) -> bytes:
    """The head's answer to `hello`, said again every HELLO_RETRY_S until one comes (a late
    answer to an earlier one is as good); TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    frame = p.encode(hello)
    while True:
        sock.send(frame)
        wait = min(HELLO_RETRY_S, deadline - time.monotonic())
        if sock.poll(max(0, int(wait * 1000))):
            return sock.recv()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no launcher answered the handshake within {timeout:.0f} s")


class EngineProcess:
    def __init__(self, rank: int, handshake_address: str,
                 placement: EnginePlacement | None = None, handshake_timeout: float = 600.0,
                 token: bytes = b""):
        """`placement`: this rank's part of the launcher's mesh (None: this engine alone on
        the devices its process sees, as a Ray actor does); `token`: the launcher's for this
        rank, for its Hello."""
        self.rank = rank
        self.token = token
        self.handshake_timeout = handshake_timeout
        self.incarnation = os.getpid()
        self.placement = placement
        self.ctx = zmq_context()
        self.links = self.ctx  # after EngineInit over CURVE: a context with the rank's key
        self.handshake = self.ctx.socket(zmq.DEALER)
        self.handshake.setsockopt(zmq.IDENTITY, routing_id(f"dp{rank}"))
        self.handshake.setsockopt(zmq.LINGER, 1000)
        self.handshake.connect(handshake_address)
        self.inputs: list[zmq.Socket] = []
        self.outputs: list[zmq.Socket] = []
        self.client_of: dict[str, int] = {}  # request id -> API server index
        self.stopping = False
        self.core: EngineCore | None = None
        self.load_out: zmq.Socket | None = None  # to the DP coordinator
        self._last_load: tuple[int, ...] | None = None
        self._last_tokens = (0, 0)
        self._next_tokens_report = 0.0
        self.received: list[int] = []  # AddRequests taken from each API server (its load says)
        self.steps: Steps | None = None  # how it steps: alone, or in waves (lockstep)
        self.sleep: SleepState | None = None  # with the core
        self.hold_while_asleep = False  # --while-asleep wait (else: refuse with a 503)
        self._heartbeat: Heartbeat | None = None

    def _send_handshake(self, msg: p._Msg) -> None:
        self.handshake.send(p.encode(msg))

    def start(self) -> None:
        answer = say_hello(self.handshake, p.Hello(self.rank, os.getpid(), self.token),
                           self.handshake_timeout)
        init = p.decode_or_drop(answer, p.EngineInit, "handshake")
        if init is None:
            raise RuntimeError("the launcher answered the handshake with a message this engine "
                               "cannot read (another parashift version?)")
        if init.rank_key is not None:  # every other link speaks for this rank, with its key
            self.links = zmq_context(role=Role(CurvePair(*init.rank_key)))
        if self.placement is not None and self.placement.cpu_ids:
            # this rank's own cores (its workers'), so that ranks do not fight over them
            os.sched_setaffinity(0, self.placement.cpu_ids)
        config = config_for_this_node(init.config)  # the launcher's, checked against here
        lockstep = config.parallel.strategy.processes().lockstep
        if lockstep and init.rank_key is not None:  # the group's store answers rank keys
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                config.parallel, expert_group_key=init.rank_key))
        self.core = (LockstepEngineCore if lockstep else EngineCore)(config,
                                                                      placement=self.placement)
        if init.kv_server and self.core.connector is not None:  # pools over nodes
            from parashift.kv_tiers.remote_tier import RemoteTier

            self.core.connector.attach_remote(RemoteTier(self.links, init.kv_server))
        self.hold_while_asleep = config.scheduler.while_asleep == "wait"
        self.sleep = SleepState(self.rank, self.core, self._answer)
        sleep = self.sleep
        self._handlers: dict[type, Callable[[Any], None]] = {
            p.AddRequest: self._add_request,
            p.AbortRequests: self._abort,
            calls.Sleep: sleep.sleep,
            calls.WakeUp: self._wake_up,
            calls.IsSleeping: sleep.is_sleeping,
            calls.ResetPrefixCache: lambda call: self._answer(call,
                                                              self.core.reset_prefix_cache()),
            calls.GetStats: lambda call: self._answer(call, self.core.stats()),
        }
        self._connect(init)
        self.steps = (LockstepSteps(self.rank, self.core, self.load_out, subscriber(
            self.links, init.coordinator_publish_address), self._publish) if lockstep
            else Steps(self.core, self._publish, self._publish_stats))
        self._announce_ready(lockstep)

    def _connect(self, init: p.EngineInit) -> None:
        """The links the launcher named: requests in, outputs out, load to the coordinator."""
        identity = routing_id(f"dp{self.rank}")  # the API servers learn it from EngineReady
        for address in init.request_addresses:
            sock = self.links.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.inputs.append(sock)
        for address in init.output_addresses:
            sock = self.links.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop outputs; in-flight work is bounded
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            self.outputs.append(sock)
        self.received = [0] * len(self.outputs)
        if init.coordinator_address:
            self.load_out = self.links.socket(zmq.PUSH)
            self.load_out.setsockopt(zmq.LINGER, 0)
            self.load_out.connect(init.coordinator_address)
            self._heartbeat = Heartbeat(self.links, init.coordinator_address, self.rank,
                                        self.incarnation)

    def _announce_ready(self, lockstep: bool) -> None:
        cfg = self.core.config
        arena = self.core.connector.arena if self.core.connector is not None else None
        # Every node names its arena alike (the head's config): the host tells them apart.
        tier = f"{socket.gethostname()}:{arena.path}" if arena is not None else None
        ready = p.EngineReady(self.rank, cfg.model.max_model_len, self.core.num_blocks,
                              self.incarnation, cfg.cache.block_size, lockstep, tier,
                              arena.num_slots if arena else 0)
        for sock in self.inputs:
            sock.send(p.encode(ready))
        self._send_handshake(p.Ready(self.rank, self.core.num_blocks, cfg.cache.block_size,
                                     cfg.model.max_model_len, self.core.weight_bytes))

    def run(self) -> None:
        poller = zmq.Poller()
        steps = self.steps
        for sock in [*self.inputs, *steps.sockets()]:
            poller.register(sock, zmq.POLLIN)
        core = self.core
        while not self.stopping:
            busy = not self.sleep.level and steps.has_work()
            for sock, _ in poller.poll(0 if busy else IDLE_POLL_MS):
                if sock not in self.inputs:
                    steps.on_socket(sock)
                    continue
                while True:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msg = p.decode_or_drop(frame, p.ToEngine, "requests")
                    if msg is not None:  # one bad message, not a dead engine
                        self._handle(msg)
            # What arrived counts before the step that may run for seconds (a long prefill):
            # the routers see it now, not after.
            self._report_load()
            steps.before_settle(self.sleep)
            self.sleep.settle(steps.has_work())
            if self.sleep.level:  # asleep: no step, no wave; held requests wait for the wake
                core.executor.check_health()
            else:
                steps.step()
            self._report_load()

    def _report_load(self) -> None:
        """Sent when its request counts change, and as its token load drifts (each step
        changes it) at most every LOAD_TOKENS_INTERVAL_S: the counts are cheap to compare,
        the tokens are a walk over its requests."""
        if self.load_out is None:
            return
        stats = self.core.stats()
        stats.num_waiting += len(self.sleep.held)  # held while asleep: a backlog all the same
        load = p.EngineLoad(self.rank, stats, None, self.sleep.level, self.sleep.released,
                            list(self.received))
        extra = self.steps.extend_load(load)
        # Whether it holds any KV block counts too: a finished request's stores may free
        # their blocks after its last report (a prefill pool's hand-off), and an engine shown
        # holding blocks it has freed would look busy to the router and /metrics for good.
        key = (stats.num_waiting, stats.num_running, extra, stats.num_prefix_cache_resets,
               stats.kv_cache_usage == 0.0, self.sleep.level, self.sleep.released,
               *self.received)
        now = time.monotonic()
        if key == self._last_load and now < self._next_tokens_report:
            return
        prefill, output = self.core.scheduler.tokens_left()
        for held in self.sleep.held.values():
            prefill += len(held.prompt_token_ids)
            output += held.params.max_tokens or 0
        stats.prefill_tokens_left, stats.output_tokens_left = prefill, output
        self._next_tokens_report = now + LOAD_TOKENS_INTERVAL_S
        if key == self._last_load and (prefill, output) == self._last_tokens:
            return
        self._last_load, self._last_tokens = key, (prefill, output)
        self.load_out.send(p.encode(load))

    def _handle(self, msg: p.ToEngine) -> None:
        try:
            self._handlers[type(msg)](msg)
        except ValueError as e:  # a bad call fails alone (a bad request: _add_request)
            if not isinstance(msg, calls.EngineCall):
                raise
            self._answer(msg, None, str(e))

    def _add_request(self, msg: p.AddRequest) -> None:
        if 0 <= msg.client_index < len(self.received):  # taken, whatever becomes of it
            self.received[msg.client_index] += 1
        if self.sleep.closed and not self.hold_while_asleep:
            self._refuse(msg, ASLEEP_MESSAGE, 503)
            return
        try:
            if self.sleep.closed:  # --while-asleep wait: admitted at the wake
                self.core.scheduler.check_room(len(self.sleep.held))
                self.sleep.held[msg.request_id] = msg
            else:
                self.core.add_request(Request(
                    msg.request_id, msg.prompt_token_ids, msg.params, msg.eos_token_id,
                    msg.arrival_time, msg.generated_token_ids, msg.hand_off))
        except ValueError as e:  # a bad request fails alone
            self._refuse(msg, str(e), 429 if isinstance(e, QueueFullError) else 400)
            return
        self.client_of[msg.request_id] = msg.client_index

    def _refuse(self, msg: p.AddRequest, error: str, status: int) -> None:
        self.outputs[msg.client_index].send(p.encode(p.RequestFailed(
            self.rank, msg.request_id, error, status)))

    def _abort(self, msg: p.AbortRequests) -> None:
        self.core.abort_requests(msg.request_ids)
        for req_id in msg.request_ids:
            self.sleep.held.pop(req_id, None)
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for req_id in msg.request_ids:
            client = self.client_of.pop(req_id, None)
            if client is not None:
                by_client.setdefault(client, []).append(
                    EngineCoreOutput(req_id, [], finish_reason="abort"))
        for client, outs in by_client.items():
            self._send_outputs(client, outs)

    def _wake_up(self, call: calls.WakeUp) -> None:
        self.sleep.wake_up(call)
        for held in self.sleep.release():
            self._add_request(held)  # awake: admitted now

    def _answer(self, call: calls.EngineCall, result: Any, error: str | None = None) -> None:
        self.outputs[call.client_index].send(p.encode(
            p.UtilityResult(self.rank, call.call_id, result, error)))

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for out in outputs:
            client = self.client_of.get(out.request_id)
            if client is None:
                continue
            by_client.setdefault(client, []).append(out)
            if out.finished:
                del self.client_of[out.request_id]
        for client, outs in by_client.items():
            self._send_outputs(client, outs)

    def _publish_stats(self) -> None:
        for client in range(len(self.outputs)):
            self._send_outputs(client, [])

    def _send_outputs(self, client: int, outputs: list[EngineCoreOutput]) -> None:
        self.outputs[client].send(p.encode(p.EngineOutputs(self.rank, outputs,
                                                           self.core.stats())))

    def report_down(self, reason: str) -> None:
        """Tell every API server at once (the rank may be on another node, where no launcher
        of theirs watches it)."""
        for sock in self.outputs:
            try:
                sock.send(p.encode(p.EngineDead(self.rank, reason, self.incarnation)),
                          zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if self.core is None:
            try:
                self._send_handshake(p.StartupFailed(self.rank, reason))
            except zmq.ZMQError:
                pass

    def close(self, linger_ms: int = 1000) -> None:
        """`linger_ms`: how long a last message (a death report) may wait for its peer."""
        if self.core is not None:
            self.core.shutdown()  # its tensor-parallel workers, if any
        if self._heartbeat is not None:  # it closes its own socket
            self._heartbeat.stop()
        if self.links is not self.ctx:
            self.links.destroy(linger=linger_ms)
        self.ctx.destroy(linger=linger_ms)


def run_engine(rank: int, handshake_address: str, log_level: str,
               placement: EnginePlacement | None = None, handshake_timeout: float = 600.0,
               token: bytes = b"") -> None:
    """Process entry point (multiprocessing target)."""
    set_process_name(engine_process_name(rank))
    die_with_parent()
    setup_child_logging(log_level)
    keep_temp_files_in_launch_folder(handshake_address)
    engine = EngineProcess(rank, handshake_address, placement, handshake_timeout, token)

    def on_term(*_: Any) -> None:
        engine.stopping = True

    if threading.current_thread() is threading.main_thread():  # not so in some Ray actors
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher orchestrates shutdown
        signal.signal(signal.SIGTERM, on_term)
    try:
        engine.start()
        engine.run()
    except Exception:
        error = traceback.format_exc()
        logger.error("engine dp%d failed:\n%s", rank, error)
        engine.report_down(error.strip().splitlines()[-1])
        time.sleep(0.2)  # let the error reach the API servers
        engine.close()
        raise SystemExit(1) from None
    # A live API server takes the report in well under a millisecond; in a whole-server
    # shutdown they are gone already, and waiting the full linger for them would only delay it.
    engine.report_down("the engine was stopped (SIGTERM)")
    engine.close(linger_ms=200)

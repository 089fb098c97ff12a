"""`parashift run`: starts the API servers, the DP coordinator and this node's engine cores,
waits for every engine's READY (with a deadline that names the rank that never came up),
watches the children, and on SIGINT/SIGTERM drains, stops every child and removes the ipc
files. No orphans. Engines of other nodes (`--headless` launchers) join through the same
handshake socket, which stays open so that restarted ranks can join again."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import time
from dataclasses import dataclass

import torch
import zmq

from parashift.config import EngineConfig
from parashift.engine.args import EngineArgs
from parashift.mesh import DeviceMesh
from parashift.models.gguf import DEFAULT_MODEL_NAME
from parashift.serve import protocol as p
from parashift.serve.api_server import ApiServerArgs, run_api_server
from parashift.serve.coordinator import run_coordinator
from parashift.serve.endpoints import Endpoints
from parashift.serve.engine_process import CpuShare
from parashift.serve.local_engines import LocalEngines, join_all
from parashift.strategies.spec import StrategySpec

logger = logging.getLogger(__name__)


class StartupError(RuntimeError):
    pass


@dataclass
class ServeArgs:
    engine: EngineArgs
    host: str = "127.0.0.1"
    port: int = 8000
    api_server_count: int = 1
    served_model_name: str | None = None
    api_key: str | None = None
    shutdown_timeout: float = 10.0
    startup_timeout: float = 600.0
    log_level: str = "INFO"
    # Multi-node data parallel (vLLM's flags) and failure handling.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = 29550
    headless: bool = False
    restart_dead_engines: bool = False
    heartbeat_timeout: float = 5.0

    def local_ranks(self, dp_size: int) -> list[int]:
        """The data-parallel ranks this node runs; checks the multi-node flags."""
        start = self.data_parallel_start_rank
        if self.headless and start < 1:
            raise ValueError("--headless needs --data-parallel-start-rank >= 1: the head node "
                             "runs the ranks from 0")
        if not self.headless and start != 0:
            raise ValueError(f"--data-parallel-start-rank {start} is for --headless nodes; "
                             "the head node runs the ranks from 0")
        local = dp_size - start if self.data_parallel_size_local is None else (
            self.data_parallel_size_local)
        if local < 1 or start + local > dp_size:
            raise ValueError(f"--data-parallel-start-rank {start} and --data-parallel-size-local "
                             f"{local} do not fit in --data-parallel-size {dp_size}")
        if self.heartbeat_timeout <= 1.0:
            raise ValueError("--heartbeat-timeout must be above 1 second (the heartbeat period)")
        return list(range(start, start + local))

    def multi_node(self, dp_size: int) -> bool:
        return (self.headless or self.data_parallel_address is not None
                or len(self.local_ranks(dp_size)) < dp_size)


def bind_listener(host: str, port: int) -> socket.socket:
    """One listening socket, shared by every API server process (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"--host {host} --port {port}: cannot listen there ({e.strerror})"
                           ) from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def node_mesh(config: EngineConfig, ranks: list[int]) -> DeviceMesh:
    """This node's part of the strategy: its dp ranks, each with its tp x pp workers, on its
    devices. Too few GPUs is an error here, before anything starts."""
    device = config.device.device
    units = len(os.sched_getaffinity(0)) if device == "cpu" else torch.cuda.device_count()
    par = config.parallel
    spec = StrategySpec.from_sizes(dp=len(ranks), tp=par.tensor_parallel_size,
                                   pp=par.pipeline_parallel_size)
    return DeviceMesh(spec, devices_per_node=max(1, units), device_type=device,
                      first_dp_rank=ranks[0])


def local_cpu_shares(mesh: DeviceMesh, num_threads: int | None) -> dict[int, CpuShare]:
    """On CPU every worker of this node's ranks gets its own slice of this process's cores
    (the mesh's rule; round-robin when there are more workers than cores). A lone rank
    without tensor parallel keeps them all, unpinned."""
    ranks = sorted({w.dp for w in mesh.ranks})
    if mesh.device_type != "cpu" or mesh.world_size == 1:
        return {rank: CpuShare([], num_threads) for rank in ranks}
    cores = sorted(os.sched_getaffinity(0))
    shares = {}
    for rank in ranks:
        workers = [[cores[c] for c in w.cpu_indices] for w in mesh.ranks if w.dp == rank]
        ids = sorted({c for w in workers for c in w})
        shares[rank] = (CpuShare(ids, num_threads or len(ids)) if mesh.tp == 1 else
                        CpuShare(ids, num_threads, workers))
    return shares


class Launcher:
    def __init__(self, args: ServeArgs):
        self.args = args
        self.config = args.engine.create_config()  # validates flags, converts a GGUF once
        self.num_engines = self.config.parallel.data_parallel_size
        self.local_ranks = args.local_ranks(self.num_engines)
        self.mesh = node_mesh(self.config, self.local_ranks)
        n = args.api_server_count
        self.endpoints = (Endpoints.tcp(args.data_parallel_address or "127.0.0.1",
                                        args.data_parallel_rpc_port, n)
                          if args.multi_node(self.num_engines) else Endpoints.local(n))
        self.ctx = zmq.Context()
        self.handshake: zmq.Socket | None = None
        self.coordinator: multiprocessing.Process | None = None
        self.api_procs: list[multiprocessing.Process] = []
        self.engines = LocalEngines(self.local_ranks, self.endpoints.handshake,
                                    local_cpu_shares(self.mesh, args.engine.num_threads),
                                    args.log_level,
                                    args.startup_timeout, args.restart_dead_engines)
        self.controls: list[zmq.Socket] = []
        self.nodes: set[bytes] = set()  # identities of headless launchers
        self.ready: dict[int, p.Ready] = {}
        self.stopping = False
        self.listener: socket.socket | None = None

    @property
    def model_name(self) -> str:
        if self.args.served_model_name:
            return self.args.served_model_name
        if self.args.engine.model is None:
            return DEFAULT_MODEL_NAME
        return os.path.basename(self.args.engine.model.rstrip("/")).removesuffix(".gguf")

    def banner(self) -> str:
        host = f"[{self.args.host}]" if ":" in self.args.host else self.args.host
        return f"parashift is serving {self.model_name!r} at http://{host}:{self.args.port}/v1"

    def start(self) -> None:
        logger.info("strategy %s; this node runs:\n%s", self.args.engine.strategy_spec(),
                    self.mesh.table())
        mp = multiprocessing.get_context("spawn")
        self.listener = bind_listener(self.args.host, self.args.port)
        self.handshake = self.ctx.socket(zmq.ROUTER)
        self.handshake.setsockopt(zmq.LINGER, 0)
        self.handshake.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted rank reuses its name
        try:
            self.handshake.bind(self.endpoints.handshake)
        except zmq.ZMQError as e:
            raise StartupError(f"cannot bind the handshake at {self.endpoints.handshake} "
                               f"(--data-parallel-address/--data-parallel-rpc-port): {e}") from e
        mc = self.config.model
        eos = getattr(mc.hf_config, "eos_token_id", None)
        coordinator_pub = None
        if self.num_engines > 1:
            self.coordinator = mp.Process(
                target=run_coordinator, name="parashift-dp-coordinator",
                args=(self.num_engines, self.endpoints.coordinator_load,
                      self.endpoints.coordinator_publish, self.args.heartbeat_timeout,
                      self.args.log_level))
            self.coordinator.start()
            coordinator_pub = self.endpoints.coordinator_publish
        for i in range(self.args.api_server_count):
            server_args = ApiServerArgs(
                i, self.endpoints.requests[i], self.endpoints.outputs[i], self.num_engines,
                mc.tokenizer_path, self.model_name, mc.max_model_len,
                eos[0] if isinstance(eos, list) else eos, mc.vocab_size, self.args.api_key,
                self.args.log_level, coordinator_pub)
            proc = mp.Process(target=run_api_server, args=(server_args, self.listener),
                              name=f"parashift-api-{i}")
            proc.start()
            self.api_procs.append(proc)
            control = self.ctx.socket(zmq.DEALER)
            control.setsockopt(zmq.IDENTITY, b"launcher")
            control.setsockopt(zmq.LINGER, 0)
            control.connect(self.endpoints.requests[i])
            self.controls.append(control)
        self.engines.start()
        self._wait_engines_ready()
        self._wait_api_servers_ready()

    def _wait_engines_ready(self) -> None:
        deadline = time.monotonic() + self.args.startup_timeout
        while len(self.ready) < self.num_engines:
            if self.stopping:
                raise StartupError("interrupted during start-up")
            self._check_children_alive()
            for death in self.engines.reap():
                raise StartupError(f"engine dp{death.rank} {death.reason} during start-up")
            if time.monotonic() > deadline:
                missing = [f"dp{r}" for r in range(self.num_engines) if r not in self.ready]
                raise StartupError(f"engine {', '.join(missing)} did not become ready within "
                                   f"{self.args.startup_timeout:.0f} s (--startup-timeout)")
            self._serve_handshake(200, starting=True)

    def _wait_api_servers_ready(self) -> None:
        """Engines are up; the URL is printed only once every API server has seen them."""
        deadline = time.monotonic() + self.args.startup_timeout
        pending = set(range(len(self.controls)))
        while pending:
            self._check_children_alive()
            if self.stopping:
                raise StartupError("interrupted during start-up")
            if time.monotonic() > deadline:
                raise StartupError(f"API server(s) {sorted(pending)} did not see the engines "
                                   f"within {self.args.startup_timeout:.0f} s")
            for i in list(pending):
                if self.controls[i].poll(50):
                    msg = p.decode(self.controls[i].recv(), p.ApiServerReady)
                    pending.discard(msg.index)

    def _serve_handshake(self, timeout_ms: int, starting: bool = False) -> None:
        """Engines (first start, restarts, other nodes) and headless launchers."""
        if not self.handshake.poll(timeout_ms):
            return
        identity, frame = self.handshake.recv_multipart()
        msg = p.decode(frame, p.Handshake)
        if isinstance(msg, p.Hello):
            engine_args = dataclasses.asdict(self.args.engine)
            if msg.rank in self.local_ranks:  # resolved here: no second GGUF lookup
                engine_args["model"] = self.config.model.path
            engine_args["data_parallel_rank"] = msg.rank
            coordinator = self.endpoints.coordinator_load if self.coordinator else None
            self.handshake.send_multipart([identity, p.encode(p.EngineInit(
                engine_args, self.endpoints.requests, self.endpoints.outputs, coordinator))])
        elif isinstance(msg, p.Ready):
            again = msg.rank in self.ready
            self.ready[msg.rank] = msg
            logger.info("engine dp%d %s: %d KV blocks of %d tokens, max_model_len %d",
                        msg.rank, "ready again" if again else "ready", msg.num_blocks,
                        msg.block_size, msg.max_model_len)
        elif isinstance(msg, p.StartupFailed):
            if starting:
                raise StartupError(f"engine dp{msg.rank} failed to start: {msg.error}")
            logger.error("engine dp%d failed to start again: %s", msg.rank, msg.error)
        elif isinstance(msg, p.NodeHello):
            self.nodes.add(identity)
            logger.info("a headless node joined with ranks dp%d-dp%d", msg.start_rank,
                        msg.start_rank + msg.size - 1)
            self.handshake.send_multipart([identity, p.encode(
                p.NodeInit(self.endpoints.coordinator_publish))])
        elif isinstance(msg, p.EngineDead):  # a headless launcher saw one of its ranks die
            if starting:
                raise StartupError(f"engine dp{msg.rank} died during start-up: {msg.reason}")
            self._announce_dead(msg)

    def _announce_dead(self, death: p.EngineDead) -> None:
        logger.error("engine dp%d died: %s", death.rank, death.reason)
        for control in self.controls:
            control.send(p.encode(death), zmq.NOBLOCK)

    def _check_children_alive(self) -> None:
        if self.coordinator is not None and self.coordinator.exitcode is not None:
            raise StartupError(f"the DP coordinator exited with code {self.coordinator.exitcode}")
        for i, proc in enumerate(self.api_procs):
            if proc.exitcode is not None:
                raise StartupError(f"API server {i} exited with code {proc.exitcode}")

    def serve_forever(self) -> int:
        """Watch the children until a signal or a fatal failure; returns the exit code.
        A dead engine is announced to the API servers (which then route around it) and, with
        --restart-dead-engines, started again."""
        while not self.stopping:
            try:
                self._check_children_alive()
            except StartupError as e:
                logger.error("%s; shutting down", e)
                return 1
            for death in self.engines.reap():
                self._announce_dead(p.EngineDead(death.rank, death.reason, death.pid))
            self.engines.restart_due()
            self._serve_handshake(200)
        return 0

    def shutdown(self) -> None:
        timeout = self.args.shutdown_timeout
        for control in self.controls:
            try:
                control.send(p.encode(p.Shutdown(timeout)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for node in self.nodes:  # headless launchers stop their engines
            try:
                self.handshake.send_multipart([node, p.encode(p.Shutdown(timeout))],
                                              zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        join_all(self.api_procs, timeout + 5)
        self.engines.stop()
        if self.coordinator is not None:
            self.coordinator.terminate()
            join_all([self.coordinator], 10)
        if self.listener is not None:
            self.listener.close()
        self.ctx.destroy(linger=500 if self.nodes else 0)
        self.endpoints.remove()


def run(args: ServeArgs) -> int:
    if args.headless:
        from parashift.serve.headless import HeadlessLauncher

        launcher: Launcher | HeadlessLauncher = HeadlessLauncher(args)
    else:
        launcher = Launcher(args)

    def on_signal(signum, _frame) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        launcher.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        launcher.start()
        print(launcher.banner(), flush=True)
        code = launcher.serve_forever()
    except StartupError as e:
        logger.error("%s", e)
        code = 1
    finally:
        launcher.shutdown()
    return code

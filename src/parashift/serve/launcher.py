"""`parashift run`: starts the API servers and engine cores, waits for every engine's READY
(with a deadline that names the rank that never came up), watches the children, and on
SIGINT/SIGTERM drains, stops every child and removes the ipc files. No orphans."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass

import torch
import zmq

from parashift.engine.args import EngineArgs
from parashift.mesh import DeviceMesh
from parashift.models.gguf import DEFAULT_MODEL_NAME
from parashift.serve import protocol as p
from parashift.serve.api_server import ApiServerArgs, run_api_server
from parashift.serve.coordinator import run_coordinator
from parashift.serve.engine_process import run_engine

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


class Launcher:
    def __init__(self, args: ServeArgs):
        self.args = args
        self.config = args.engine.create_config()  # validates flags, converts a GGUF once
        self.num_engines = self.config.parallel.data_parallel_size
        device = self.config.device.device
        units = len(os.sched_getaffinity(0)) if device == "cpu" else max(
            1, torch.cuda.device_count())
        self.mesh = DeviceMesh(self.args.engine.strategy_spec(), devices_per_node=units,
                               device_type=device)
        self.ipc_dir = tempfile.mkdtemp(prefix="parashift-")
        self.ctx = zmq.Context()
        self.handshake_address = f"ipc://{self.ipc_dir}/handshake"
        n = args.api_server_count
        self.request_addresses = [f"ipc://{self.ipc_dir}/api{i}-requests" for i in range(n)]
        self.output_addresses = [f"ipc://{self.ipc_dir}/api{i}-outputs" for i in range(n)]
        # The DP coordinator, only with several engines: engines push load, API servers listen.
        self.coordinator_addresses = (f"ipc://{self.ipc_dir}/coordinator-load",
                                      f"ipc://{self.ipc_dir}/coordinator-pub")
        self.coordinator: multiprocessing.Process | None = None
        self.api_procs: list[multiprocessing.Process] = []
        self.engine_procs: list[multiprocessing.Process] = []
        self.controls: list[zmq.Socket] = []
        self.stopping = False
        self.listener: socket.socket | None = None

    @property
    def model_name(self) -> str:
        if self.args.served_model_name:
            return self.args.served_model_name
        if self.args.engine.model is None:
            return DEFAULT_MODEL_NAME
        return os.path.basename(self.args.engine.model.rstrip("/")).removesuffix(".gguf")

    def start(self) -> None:
        logger.info("strategy %s on this node:\n%s", self.mesh.spec, self.mesh.table())
        mp = multiprocessing.get_context("spawn")
        self.listener = bind_listener(self.args.host, self.args.port)
        handshake = self.ctx.socket(zmq.ROUTER)
        handshake.setsockopt(zmq.LINGER, 0)
        handshake.bind(self.handshake_address)
        mc = self.config.model
        eos = getattr(mc.hf_config, "eos_token_id", None)
        coordinator_pub = None
        if self.num_engines > 1:
            self.coordinator = mp.Process(
                target=run_coordinator,
                args=(self.num_engines, *self.coordinator_addresses, self.args.log_level),
                name="parashift-dp-coordinator")
            self.coordinator.start()
            coordinator_pub = self.coordinator_addresses[1]
        for i in range(self.args.api_server_count):
            server_args = ApiServerArgs(
                i, self.request_addresses[i], self.output_addresses[i], self.num_engines,
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
            control.connect(self.request_addresses[i])
            self.controls.append(control)
        for rank in range(self.num_engines):
            proc = mp.Process(target=run_engine,
                              args=(rank, self.handshake_address, self.args.log_level),
                              name=f"parashift-engine-dp{rank}")
            proc.start()
            self.engine_procs.append(proc)
        try:
            self._handshake(handshake)
        finally:
            handshake.close()
        self._wait_api_servers_ready()

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

    def _handshake(self, sock: zmq.Socket) -> None:
        engine_args = dataclasses.asdict(self.args.engine)
        engine_args["model"] = self.config.model.path  # resolved: no second GGUF lookup
        ready: dict[int, p.Ready] = {}
        deadline = time.monotonic() + self.args.startup_timeout
        while len(ready) < self.num_engines:
            if self.stopping:
                raise StartupError("interrupted during start-up")
            self._check_children_alive()
            if time.monotonic() > deadline:
                missing = [f"dp{r}" for r in range(self.num_engines) if r not in ready]
                raise StartupError(f"engine {', '.join(missing)} did not become ready within "
                                   f"{self.args.startup_timeout:.0f} s (--startup-timeout)")
            if not sock.poll(200):
                continue
            identity, frame = sock.recv_multipart()
            msg = p.decode(frame, p.Handshake)
            if isinstance(msg, p.Hello):
                cpu_ids, threads = self._cpu_share(msg.rank)
                init = p.EngineInit({**engine_args, "data_parallel_rank": msg.rank},
                                    self.request_addresses, self.output_addresses, threads,
                                    cpu_ids, self._coordinator_load_address())
                sock.send_multipart([identity, p.encode(init)])
            elif isinstance(msg, p.StartupFailed):
                raise StartupError(f"engine dp{msg.rank} failed to start: {msg.error}")
            elif isinstance(msg, p.Ready):
                ready[msg.rank] = msg
                logger.info("engine dp%d ready: %d KV blocks of %d tokens, max_model_len %d",
                            msg.rank, msg.num_blocks, msg.block_size, msg.max_model_len)

    def _coordinator_load_address(self) -> str | None:
        return self.coordinator_addresses[0] if self.coordinator is not None else None

    def _cpu_share(self, rank: int) -> tuple[list[int], int | None]:
        """On CPU each data-parallel rank gets its own slice of this process's cores."""
        placement = self.mesh.ranks[rank]  # dp only today: worker rank == dp rank
        if not placement.cpu_indices or self.num_engines == 1:
            return [], self.args.engine.num_threads
        cores = sorted(os.sched_getaffinity(0))
        share = [cores[i] for i in placement.cpu_indices]
        return share, self.args.engine.num_threads or len(share)

    def _check_children_alive(self) -> None:
        if self.coordinator is not None and self.coordinator.exitcode is not None:
            raise StartupError(f"the DP coordinator exited with code {self.coordinator.exitcode}")
        for i, proc in enumerate(self.api_procs):
            if proc.exitcode is not None:
                raise StartupError(f"API server {i} exited with code {proc.exitcode}")
        for rank, proc in enumerate(self.engine_procs):
            if proc.exitcode is not None:
                raise StartupError(f"engine dp{rank} exited with code {proc.exitcode} "
                                   "during start-up")

    def serve_forever(self) -> int:
        """Watch the children until a signal or a fatal failure; returns the exit code."""
        dead_engines: set[int] = set()
        while not self.stopping:
            sentinels = [proc.sentinel for proc in self.api_procs + self.engine_procs]
            if self.coordinator is not None:
                sentinels.append(self.coordinator.sentinel)
            multiprocessing.connection.wait(sentinels, timeout=0.5)
            if self.coordinator is not None and self.coordinator.exitcode is not None:
                logger.error("the DP coordinator exited with code %s; shutting down",
                             self.coordinator.exitcode)
                return 1
            for i, proc in enumerate(self.api_procs):
                if proc.exitcode is not None:
                    logger.error("API server %d exited with code %s; shutting down", i,
                                 proc.exitcode)
                    return 1
            for rank, proc in enumerate(self.engine_procs):
                if proc.exitcode is not None and rank not in dead_engines:
                    dead_engines.add(rank)
                    reason = f"process exited with code {proc.exitcode}"
                    logger.error("engine dp%d died: %s", rank, reason)
                    for control in self.controls:
                        control.send(p.encode(p.EngineDead(rank, reason)), zmq.NOBLOCK)
        return 0

    def shutdown(self) -> None:
        timeout = self.args.shutdown_timeout
        for control in self.controls:
            try:
                control.send(p.encode(p.Shutdown(timeout)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        _join_all(self.api_procs, timeout + 5)
        others = self.engine_procs + ([self.coordinator] if self.coordinator else [])
        for proc in others:
            if proc.is_alive():
                proc.terminate()
        _join_all(others, 10)
        if self.listener is not None:
            self.listener.close()
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _join_all(procs: list[multiprocessing.Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            logger.warning("%s did not stop in time; killing it", proc.name)
            proc.kill()
            proc.join(5)


def run(args: ServeArgs) -> int:
    launcher = Launcher(args)

    def on_signal(signum, _frame) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        launcher.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        launcher.start()
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"parashift is serving {launcher.model_name!r} at http://{host}:{args.port}/v1",
              flush=True)
        code = launcher.serve_forever()
    except StartupError as e:
        logger.error("%s", e)
        code = 1
    finally:
        launcher.shutdown()
    return code

"""The executor for an engine with workers of its own (tp, pp): one process per rank of the
engine's placement (strategies/mesh.py), driven by the engine core over ZMQ (measured in
docs/BENCHMARKS.md: a step command is a few kB, sent to each worker's own ipc socket). Each
step goes to every worker; the output rank (last stage, tp rank 0) answers. Steps may be
submitted before the previous ones answered (a pipeline's batches in flight): workers run
them in order and the answers come back in that order. A worker that dies takes its
engine down with a clear error (the launcher then reports the rank dead), and workers die
with their engine (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import collections
import contextlib
import glob
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import weakref
from typing import Any

import zmq

from parashift.config import EngineConfig
from parashift.distributed import shm_all_reduce
from parashift.executor.worker_process import WorkerArgs, run_worker
from parashift.processes import exit_after, join_within
from parashift.strategies.mesh import EnginePlacement
from parashift.types.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from parashift.wire import protocol as p
from parashift.wire import worker_protocol as wp
from parashift.wire.sockets import zmq_context

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a wait for workers checks that they are all alive


class WorkerDiedError(RuntimeError):
    pass


class WorkerProcesses:
    """An engine's workers as processes of this node, spawned: ipc sockets and a FileStore
    in a private folder."""

    def __init__(self, config: EngineConfig, placement: EnginePlacement, log_level: str):
        self.dir = tempfile.mkdtemp(prefix=f"parashift-dp{placement.engine}-workers-")
        self.ctx = zmq_context()
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(f"ipc://{self.dir}/results")
        self.commands: list[zmq.Socket] = []
        self.names = [w.process_name for w in placement.workers]
        on_cpu = all(w.cuda_index is None for w in placement.workers)
        # Workers on CPU sum through shared memory; the files are gone once all have mapped them.
        use_shm = on_cpu and config.parallel.shm_all_reduce and shm_all_reduce.supported()
        self.shm_path = (shm_all_reduce.shm_path(f"{os.getpid()}-dp{placement.engine}")
                         if use_shm else None)
        mp = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.Process] = []
        for worker in placement.workers:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            address = f"ipc://{self.dir}/worker{worker.local_rank}"
            sock.bind(address)
            self.commands.append(sock)
            args = WorkerArgs(config, worker, f"file://{self.dir}/dist-init", address,
                              f"ipc://{self.dir}/results", log_level, self.shm_path)
            proc = mp.Process(target=exit_after, args=(run_worker, args),
                              name=worker.process_name)
            proc.start()
            self.procs.append(proc)

    def check_health(self) -> None:
        for proc in self.procs:
            if proc.exitcode is not None:
                raise WorkerDiedError(f"worker {proc.name} exited with code "
                                      f"{proc.exitcode}")

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def cleanup_call(self) -> tuple:
        """What ends them, as a weakref.finalize callback and its arguments."""
        return _kill_workers, self.procs, self.commands, self.ctx, self.dir, self.shm_path


class MultiprocExecutor:
    """`workers`: how the workers are started and watched (WorkerProcesses here; the Ray
    executor's actors, executor/ray_executor.py); the executor talks to them over ZMQ."""

    def __init__(self, config: EngineConfig, placement: EnginePlacement,
                 log_level: str = "INFO", startup_timeout: float = 600.0,
                 workers: type = WorkerProcesses):
        count = len(placement.workers)
        self.max_batches_in_flight = config.parallel.strategy.processes().max_batches_in_flight
        self._results: collections.deque[ModelRunnerOutput] = collections.deque()
        self.workers = workers(config, placement, log_level)
        self.results, self.commands = self.workers.results, self.workers.commands
        self.names = self.workers.names
        # However this executor ends (even unreferenced, or at exit), no worker outlives it.
        self._cleanup = weakref.finalize(self, *self.workers.cleanup_call())
        try:
            self._collect(wp.WorkerReady, count, startup_timeout)
        except Exception:
            self.shutdown()
            raise
        logger.info("%d workers ready (%s)", count,
                    "gloo" if config.device.device == "cpu" else "nccl")

    # --- the executor interface (LocalExecutor's, plus submit / wait for batches in flight) --
    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def weight_bytes(self) -> list[int]:
        return self.collective_rpc("weight_bytes")

    def kv_block_bytes(self) -> int:
        return max(self.collective_rpc("kv_block_bytes"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", num_blocks)

    @property
    def num_workers(self) -> int:
        return len(self.commands)

    def attach_kv_tiers(self, *link) -> None:
        self.collective_rpc("attach_kv_tiers", *link)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.wait()

    def sleep(self, level: int) -> list[int]:
        """Bytes each worker released."""
        return self.collective_rpc("sleep", level)

    def wake_up(self) -> None:
        self.collective_rpc("wake_up")

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step; its output comes from `wait`, in submission order."""
        self._broadcast(wp.ExecuteModel(scheduler_output))

    def sample_tokens(self, grammar: GrammarBitmask | None) -> None:
        """The mask of the deferred step submitted last: its output comes from `wait`."""
        self._broadcast(wp.SampleTokens(grammar))

    def wait(self) -> ModelRunnerOutput:
        """The output of the oldest submitted step not yet waited for."""
        if not self._results:
            self._collect(wp.StepResult, 1)
        return self._results.popleft()

    def check_health(self) -> None:
        """Raises if a worker has died (the engine calls this even when idle)."""
        self.workers.check_health()

    def shutdown(self) -> None:
        if not self._cleanup.alive:
            return
        try:
            if self.workers.alive():
                self.collective_rpc("stop", timeout=10)
        except (WorkerDiedError, TimeoutError):
            pass
        self._cleanup()

    # --- plumbing -----------------------------------------------------------------------------
    def _broadcast(self, msg: p._Msg) -> None:
        data = p.encode(msg)
        for sock in self.commands:
            sock.send(data)

    def collective_rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """Calls `Worker.method(*args)` on every worker; their results in worker order."""
        self._broadcast(wp.WorkerCall(method, list(args)))
        replies = self._collect(wp.WorkerReply, len(self.commands), timeout)
        return [r.result for r in sorted(replies, key=lambda r: r.rank)]

    def _collect(self, kind: type, count: int, timeout: float | None = None) -> list[Any]:
        """`count` messages of `kind`, checking meanwhile that every worker is alive."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        while len(out) < count:
            if self.results.poll(POLL_MS):
                msg = p.decode_or_drop(self.results.recv(), wp.FromWorker, "worker results")
                if isinstance(msg, wp.WorkerReply) and msg.error is not None:
                    raise WorkerDiedError(f"worker {self.names[msg.rank]} failed: {msg.error}")
                if isinstance(msg, wp.StepResult):  # kept in order, whoever is waiting
                    self._results.append(msg.output)
                    if kind is wp.StepResult:
                        out.append(msg)
                elif isinstance(msg, kind):
                    out.append(msg)
                continue
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the engine's workers did not answer within {timeout} s")
        return out


def _kill_workers(procs: list[multiprocessing.Process], commands: list[zmq.Socket],
                  ctx: zmq.Context, folder: str, shm_file: str | None) -> None:
    # Unreferenced without shutdown(), the workers still wait for a command: tell them to
    # stop (after a "stop" call they are on their way out already, and never read this).
    stop = p.encode(wp.WorkerCall("stop", []))
    for sock in commands:
        with contextlib.suppress(zmq.ZMQError):
            sock.send(stop, zmq.NOBLOCK)
    join_within(procs, 5.0)
    for escalate in (multiprocessing.Process.terminate, multiprocessing.Process.kill):
        alive = [proc for proc in procs if proc.is_alive()]
        for proc in alive:
            escalate(proc)
        join_within(alive, 5.0)
    ctx.destroy(linger=0)
    shutil.rmtree(folder, ignore_errors=True)
    if shm_file is not None:  # one per tp group, if a worker died before its rank 0 removed it
        for path in glob.glob(f"{glob.escape(shm_file)}-*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

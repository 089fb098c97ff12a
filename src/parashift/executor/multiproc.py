"""The executor for tensor parallel: `tp` worker processes, one per device, driven by the
engine core over ZMQ (measured in docs/BENCHMARKS.md: a step command is a few kB, sent to
each worker's own ipc socket). Each step goes to every worker; tp rank 0 answers. A worker
that dies takes its engine down with a clear error (the launcher then reports the rank dead),
and workers die with their engine (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import weakref
from typing import Any

import torch
import zmq

from parashift import env
from parashift.config import EngineConfig
from parashift.distributed import shm_all_reduce
from parashift.executor.worker_process import WorkerArgs, run_worker
from parashift.types.outputs import ModelRunnerOutput, SchedulerOutput
from parashift.wire import protocol as p
from parashift.wire.process_util import exit_after

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a wait for workers checks that they are all alive


class WorkerDiedError(RuntimeError):
    pass


def split_cores(cores: list[int], parts: int) -> list[list[int]]:
    """Equal slices of `cores`; with fewer cores than parts, one core each, round-robin."""
    if len(cores) >= parts:
        size = len(cores) // parts
        return [cores[i * size:(i + 1) * size] for i in range(parts)]
    return [[cores[i % len(cores)]] for i in range(parts)]


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, worker_cpu_ids: list[list[int]] | None = None,
                 log_level: str = "INFO", startup_timeout: float = 600.0):
        tp = config.parallel.tensor_parallel_size
        self._start_workers(config, worker_cpu_ids, log_level)
        # However this executor ends (even unreferenced, or at exit), no worker outlives it.
        self._cleanup = weakref.finalize(self, *self._cleanup_call())
        try:
            self._collect(p.WorkerReady, tp, startup_timeout)
        except Exception:
            self.shutdown()
            raise
        logger.info("%d tensor-parallel workers ready (%s)", tp,
                    "gloo" if config.device.device == "cpu" else "nccl")

    def _start_workers(self, config: EngineConfig, worker_cpu_ids: list[list[int]] | None,
                       log_level: str) -> None:
        """One process per tp rank, ipc sockets and a FileStore in a private folder."""
        tp = config.parallel.tensor_parallel_size
        dp_rank = config.parallel.data_parallel_rank
        self.dir = tempfile.mkdtemp(prefix=f"parashift-dp{dp_rank}-workers-")
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(f"ipc://{self.dir}/results")
        self.commands: list[zmq.Socket] = []
        if worker_cpu_ids is None and config.device.device == "cpu":
            worker_cpu_ids = split_cores(sorted(os.sched_getaffinity(0)), tp)
        gpus = torch.cuda.device_count() if config.device.device != "cpu" else 0
        if config.device.device != "cpu" and tp > gpus:
            raise ValueError(f"tp{tp} needs {tp} GPUs on this node; {gpus} visible")
        first_gpu = (dp_rank * tp) % gpus if gpus else 0  # this node's dp ranks, side by side
        # Workers on CPU sum through shared memory; the file is gone once all have mapped it.
        use_shm = gpus == 0 and env.shm_all_reduce() and shm_all_reduce.supported()
        self.shm_path = shm_all_reduce.shm_path(f"{os.getpid()}-dp{dp_rank}") if use_shm else None
        mp = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.Process] = []
        for rank in range(tp):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"ipc://{self.dir}/worker{rank}")
            self.commands.append(sock)
            name = f"parashift-worker-dp{dp_rank}-tp{rank}"
            args = WorkerArgs(config, name, rank, tp, f"file://{self.dir}/dist-init",
                              f"ipc://{self.dir}/worker{rank}", f"ipc://{self.dir}/results",
                              worker_cpu_ids[rank] if worker_cpu_ids else [],
                              (first_gpu + rank) % gpus if gpus else None, log_level,
                              self.shm_path)
            proc = mp.Process(target=exit_after, args=(run_worker, args), name=name)
            proc.start()
            self.procs.append(proc)

    def _cleanup_call(self) -> tuple:
        return _kill_workers, self.procs, self.ctx, self.dir, self.shm_path

    def _alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    # --- the executor interface (same as LocalExecutor) ---------------------------------------
    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def kv_block_bytes(self) -> int:
        return max(self.collective_rpc("kv_block_bytes"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(p.ExecuteModel(scheduler_output))
        (result,) = self._collect(p.StepResult, 1)
        return result.output

    def check_health(self) -> None:
        """Raises if a worker has died (the engine calls this even when idle)."""
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                raise WorkerDiedError(f"worker tp{rank} ({proc.name}) exited with code "
                                      f"{proc.exitcode}")

    def shutdown(self) -> None:
        if not self._cleanup.alive:
            return
        try:
            if self._alive():
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
        """Calls `Worker.method(*args)` on every worker; their results in tp-rank order."""
        self._broadcast(p.WorkerCall(method, list(args)))
        replies = self._collect(p.WorkerReply, len(self.commands), timeout)
        return [r.result for r in sorted(replies, key=lambda r: r.rank)]

    def _collect(self, kind: type, count: int, timeout: float | None = None) -> list[Any]:
        """`count` messages of `kind`, checking meanwhile that every worker is alive."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        while len(out) < count:
            if self.results.poll(POLL_MS):
                msg = p.decode(self.results.recv(), p.FromWorker)
                if isinstance(msg, p.WorkerReply) and msg.error is not None:
                    raise WorkerDiedError(f"worker tp{msg.rank} failed: {msg.error}")
                if isinstance(msg, kind):
                    out.append(msg)
                continue
            self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers did not answer within {timeout} s")
        return out


def _kill_workers(procs: list[multiprocessing.Process], ctx: zmq.Context, folder: str,
                  shm_file: str | None) -> None:
    for proc in procs:  # after a "stop" call they are on their way out
        proc.join(5)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    ctx.destroy(linger=0)
    shutil.rmtree(folder, ignore_errors=True)
    if shm_file is not None:  # workers that died before tp rank 0 removed it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_file)

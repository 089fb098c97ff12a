"""A tensor-parallel worker process: one device, the model shard and its slice of the KV cache.
It joins its engine's tp group (torch.distributed: gloo on CPU, nccl on GPU; rendezvous through
a file in the engine's private folder, so that engines starting at once never fight over a
port), then runs the step commands its engine core sends. Every worker runs every step;
only tp rank 0 answers with the sampled tokens."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import threading
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import zmq

from parashift.config import EngineConfig
from parashift.distributed.communicator import GroupCommunicator
from parashift.distributed.parallel_state import set_tp_group
from parashift.distributed.shm_all_reduce import ShmAllReduce
from parashift.wire import protocol as p
from parashift.wire.process_util import die_with_parent, set_process_name, setup_child_logging

logger = logging.getLogger(__name__)

# A collective that waits this long means a peer is gone; the engine notices dead workers
# sooner, through their process sentinels.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class WorkerArgs:
    config: EngineConfig  # the engine's, model path resolved
    name: str  # process name, e.g. parashift-worker-dp0-tp1
    tp_rank: int
    tp_size: int
    init_method: str  # torch.distributed rendezvous: file:// (mp) or tcp:// (Ray)
    command_address: str  # engine PUSH -> this worker's PULL
    result_address: str  # this worker's PUSH -> engine PULL
    cpu_ids: list[int]  # this worker's cores (empty: no pinning)
    cuda_device: int | None  # GPU index on this node
    log_level: str
    shm_path: str | None = None  # where the ranks meet for shared-memory all-reduce (one node)


def run_worker(args: WorkerArgs) -> None:
    """Process entry point (multiprocessing target)."""
    set_process_name(args.name)
    die_with_parent()
    setup_child_logging(args.log_level)
    if threading.current_thread() is threading.main_thread():  # not so in some Ray actors
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when we stop
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(args.command_address)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 1000)
    results.connect(args.result_address)
    try:
        worker = _init(args)
        results.send(p.encode(p.WorkerReady(args.tp_rank)))
        _serve(worker, args.tp_rank, commands, results)
    except Exception:
        error = traceback.format_exc()
        logger.error("%s failed:\n%s", args.name, error)
        results.send(p.encode(p.WorkerReply(args.tp_rank, None, error.strip().splitlines()[-1])))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        ctx.destroy(linger=1000)


def _init(args: WorkerArgs):
    from parashift.executor.worker import Worker

    config = args.config
    if args.cuda_device is not None:
        torch.cuda.set_device(args.cuda_device)
        backend = "nccl"
    else:
        backend = "gloo"
        if args.cpu_ids:
            os.sched_setaffinity(0, args.cpu_ids)
        threads = config.device.num_threads or len(args.cpu_ids) or None
        config = dataclasses.replace(config, device=dataclasses.replace(
            config.device, num_threads=threads))
    dist.init_process_group(backend, init_method=args.init_method,
                            rank=args.tp_rank, world_size=args.tp_size,
                            timeout=COLLECTIVE_TIMEOUT)
    shm = None
    if args.shm_path:  # set by the engine only for CPU workers that can use it
        shm = ShmAllReduce.open(args.shm_path, args.tp_rank, args.tp_size, dist.group.WORLD)
    set_tp_group(GroupCommunicator(dist.group.WORLD, args.tp_rank, args.tp_size, shm))
    return Worker(config)


def _serve(worker, rank: int, commands: zmq.Socket, results: zmq.Socket) -> None:
    while True:
        msg = p.decode(commands.recv(), p.ToWorker)
        if isinstance(msg, p.ExecuteModel):
            output = worker.execute_model(msg.scheduler_output)
            if rank == 0:
                results.send(p.encode(p.StepResult(output)))
        elif msg.method == "stop":
            results.send(p.encode(p.WorkerReply(rank)))
            return
        else:
            result = getattr(worker, msg.method)(*msg.args)
            results.send(p.encode(p.WorkerReply(rank, result)))

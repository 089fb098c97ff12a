"""A worker process: one device of its engine, the model shard and its slice of the KV cache.
It joins its engine's workers (torch.distributed: gloo on CPU, nccl on GPU; rendezvous through
a file in the engine's private folder, so that engines starting at once never fight over a
port), forms the in-engine process groups the strategy names, loads the shard its plan says,
then runs the step commands its engine core sends. Every worker runs every step, in the order
sent (so a pipeline stage can start the next batch while later stages run this one); only the
last stage's tp rank 0 answers with the sampled tokens."""

from __future__ import annotations

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
from parashift.distributed.expert_group import cross_engine_groups
from parashift.distributed.network_interface import interface_of
from parashift.distributed.parallel_context import ParallelContext
from parashift.distributed.shm_all_reduce import ShmAllReduce
from parashift.executor.step_result import Sampled, StepResult
from parashift.processes import die_with_parent, set_process_name, setup_child_logging
from parashift.strategies.layout import MeshPoint
from parashift.strategies.mesh import RankPlacement
from parashift.wire import protocol as p
from parashift.wire import worker_protocol as wp
from parashift.wire.cluster_auth import CurvePair, Role
from parashift.wire.lockstep_protocol import ExecuteWaveStep, WaveStepResult
from parashift.wire.sockets import zmq_context

logger = logging.getLogger(__name__)

# A collective that waits this long means a peer is gone; the engine notices dead workers
# sooner, through their process sentinels.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class WorkerArgs:
    config: EngineConfig  # the engine's, model path resolved
    placement: RankPlacement  # from the mesh: name, coordinates, cores or GPU
    init_method: str  # torch.distributed rendezvous: file:// (mp) or tcp:// (Ray)
    command_address: str  # engine PUSH -> this worker's PULL
    result_address: str  # this worker's PUSH -> engine PULL
    log_level: str
    shm_path: str | None = None  # where tp ranks meet for shared-memory all-reduce (one node)
    store_listen_fd: int | None = None  # tcp:// rendezvous: worker 0's bound store socket
    # tcp:// links (Ray): this worker's own key pair (z85 public, secret), from its engine,
    # the only key its command socket admits (wire/cluster_auth.py WorkerKeys)
    link_key: tuple[bytes, bytes] | None = None

    @property
    def name(self) -> str:
        return self.placement.process_name

    @property
    def rank(self) -> int:  # among its engine's workers
        return self.placement.local_rank


def run_worker(args: WorkerArgs) -> None:
    """Process entry point (multiprocessing target)."""
    set_process_name(args.name)
    die_with_parent()
    setup_child_logging(args.log_level)
    if threading.current_thread() is threading.main_thread():  # not so in some Ray actors
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when we stop
    ctx = zmq_context(role=Role(CurvePair(*args.link_key)) if args.link_key else None)
    commands = ctx.socket(zmq.PULL)
    commands.connect(args.command_address)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 1000)
    results.connect(args.result_address)
    try:
        worker = _init(args)
        results.send(p.encode(wp.WorkerReady(args.rank)))
        _serve(worker, args.rank, commands, results)
    except Exception:
        error = traceback.format_exc()
        logger.error("%s failed:\n%s", args.name, error)
        results.send(p.encode(wp.WorkerReply(args.rank, None, error.strip().splitlines()[-1])))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        ctx.destroy(linger=1000)


def _init(args: WorkerArgs):
    from parashift.executor.lockstep_worker import LockstepWorker
    from parashift.executor.worker import Worker, threads_for, worker_class

    config, placement = args.config, args.placement
    if placement.cuda_index is not None:
        torch.cuda.set_device(placement.cuda_index)
        backend = "nccl"
    else:
        backend = "gloo"
        if placement.cpu_ids:
            os.sched_setaffinity(0, placement.cpu_ids)
    spec = config.parallel.strategy
    world_size = spec.processes().workers_per_engine
    tcp = args.init_method.startswith("tcp://")
    host, _, port = args.init_method.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]") if tcp else "127.0.0.1"
    if backend == "gloo":  # its pairs on the store's interface (one node: loopback), not on
        # whichever the host name resolves to
        os.environ["GLOO_SOCKET_IFNAME"] = interface_of(host)
    if tcp:  # worker 0 hosts the store on its bound socket
        store = dist.TCPStore(host, int(port), world_size, args.rank == 0,
                              timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False,
                              master_listen_fd=args.store_listen_fd)
        dist.init_process_group(backend, store=store, rank=args.rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group(backend, init_method=args.init_method, rank=args.rank,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    groups = _join_groups(spec.local_groups(), args.rank, args.shm_path,
                          config.device.deterministic)
    groups.update(cross_engine_groups(spec, config.parallel.expert_group_address,
                                      config.parallel.expert_group_key,
                                      placement.coords, backend == "nccl"))
    shard = spec.shard(MeshPoint(placement.coords, spec.sizes()), config.model.hf_config)
    base = LockstepWorker if spec.processes().lockstep else Worker
    return worker_class(config, base)(config, ParallelContext(shard, groups),
                                      threads_for(config, placement.cpu_ids))


def _join_groups(groups: dict[str, list[list[int]]], rank: int, shm_path: str | None,
                 deterministic: bool = False) -> dict[str, GroupCommunicator]:
    """A communicator for each named group this worker is in. Every worker creates every
    group, in the same order (torch.distributed requires it)."""
    world = dist.get_world_size()
    mine = {}
    for name, member_lists in groups.items():
        for index, members in enumerate(member_lists):
            group = dist.group.WORLD if len(members) == world else dist.new_group(members)
            if rank not in members or len(members) == 1:
                continue
            shm = None
            if shm_path and name == "tp":  # all-reduces that fit go through shared memory
                shm = ShmAllReduce.open(f"{shm_path}-{index}", members.index(rank),
                                        len(members), group)
            mine[name] = GroupCommunicator(group, members.index(rank), len(members), shm,
                                           deterministic)
    return mine


def _serve(worker, rank: int, commands: zmq.Socket, results: zmq.Socket) -> None:
    answers = worker.is_output_rank  # only the output rank answers a step
    while True:
        msg = p.decode_or_drop(commands.recv(), wp.ToWorker, "worker commands")
        if msg is None:
            continue
        if isinstance(msg, wp.WorkerCall):
            if msg.method == "stop":
                worker.stop()
                results.send(p.encode(wp.WorkerReply(rank)))
                return
            result = getattr(worker, msg.method)(*msg.args)
            results.send(p.encode(wp.WorkerReply(rank, result)))
            continue
        reply = _STEPS[type(msg)](worker, msg)
        if answers and reply is not None:
            results.send(p.encode(reply))


def _step_reply(result: StepResult) -> wp.StepResult | None:
    """None: DEFERRED (it answers at SampleTokens), or not the output rank."""
    return wp.StepResult(result.host_output()) if isinstance(result, Sampled) else None


# The step commands, by type: the reply each sends (None: nothing).
_STEPS = {
    wp.ExecuteModel: lambda worker, msg: _step_reply(worker.execute_model(msg.scheduler_output)),
    wp.SampleTokens: lambda worker, msg: _step_reply(worker.sample_tokens(msg.grammar)),
    ExecuteWaveStep: lambda worker, msg: WaveStepResult(
        worker.execute_wave_step(msg.scheduler_output, msg.has_work)),
}

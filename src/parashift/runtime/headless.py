"""`parashift run --headless`: a node that runs only engine cores (ranks start .. start +
local - 1) for a head node elsewhere. It introduces itself to the head (NodeHello) and gets
the config the head resolved (NodeInit): it resolves none of its own, but checks that config
against what it knows (the engine flags given here, this node's devices, memory and copy of
the model) and refuses a mismatch, naming both values, before its engines start. They join
the head's handshake over TCP like local ones and run the same config. The launcher then
reports its engines' deaths to the head (and restarts them when asked), and stops when the
head says so -- or when the head's coordinator has been silent for --heartbeat-timeout, so
that a dead head leaves no engines behind on other nodes."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from operator import attrgetter
from typing import Any, NoReturn

import msgspec
import zmq

from parashift.config import EngineConfig
from parashift.defaults import DEFAULT_CPU_KV_CACHE_MEMORY, resolve_dtype_name
from parashift.engine.args import EngineArgs, config_for_this_node, gemm_paths, strategy_spec
from parashift.engine.placement import node_mesh
from parashift.kv_tiers import shm_files
from parashift.runtime.local_engines import LocalEngines
from parashift.runtime.node import ServeArgs, StartupError
from parashift.strategies.mesh import DeviceMesh
from parashift.strategies.spec import StrategyAxis, StrategySpec
from parashift.wire import protocol as p
from parashift.wire.cluster_auth import handshake_failed
from parashift.wire.engine_config import EngineConfigWire
from parashift.wire.sockets import routing_id, subscriber, tcp_url, zmq_context

logger = logging.getLogger(__name__)

class HeadlessLauncher:
    def __init__(self, args: ServeArgs):
        self.args = args
        own = flagged_strategy(args.engine)  # the size, where this node's flags name it
        self.local_ranks = args.local_ranks(own.processes().num_engines if own else None)
        args.check_backend()  # --backend ray places ranks itself: no headless nodes
        args.check_cluster_secret(tcp=True)
        self.head = tcp_url(args.data_parallel_address or "127.0.0.1",
                            args.data_parallel_rpc_port)
        self.engines: LocalEngines | None = None  # once the head's config is checked
        self.kv_host_tier: str | None = None  # the node's arena, named by the head
        self.ctx = zmq_context()
        self.to_head = self.ctx.socket(zmq.DEALER)
        self.to_head.setsockopt(zmq.IDENTITY, routing_id(f"node-{self.local_ranks[0]}"))
        self.to_head.setsockopt(zmq.LINGER, 1000)
        self.head_heartbeats: zmq.Socket | None = None
        self.stopping = False

    def banner(self) -> str:
        ranks = ", ".join(f"dp{r}" for r in self.local_ranks)
        return f"parashift headless node: engines {ranks} serve the head at {self.head}"

    def start(self) -> None:
        logger.info("headless node: engines %s, head at %s",
                    ", ".join(f"dp{r}" for r in self.local_ranks), self.head)
        monitor = self.to_head.get_monitor_socket()
        self.to_head.connect(self.head)
        self.to_head.send(p.encode(p.NodeHello(self.local_ranks[0], len(self.local_ranks))))
        init = self._wait_for_head(monitor)
        try:
            mesh = check_node(self.args, init.config, self.local_ranks)
            # the head named this node's arena in its ranks' config (Launcher._engine_init)
            self.kv_host_tier = init.config.cache.kv_host_tier
        except ValueError as e:
            self._refuse(str(e))
        logger.info("the head's config checked; this node runs:\n%s", mesh.table())
        self.engines = LocalEngines(
            {r: mesh.engine_placement(r) for r in self.local_ranks}, self.head,
            self.args.log_level, self.args.startup_timeout, self.args.restart_dead_engines)
        self.head_heartbeats = subscriber(self.ctx, init.coordinator_publish_address)
        self.engines.start()

    def _wait_for_head(self, monitor: zmq.Socket) -> p.NodeInit:
        deadline = time.monotonic() + self.args.startup_timeout
        while not self.to_head.poll(200):
            if handshake_failed(monitor):
                raise StartupError(
                    f"the head node at {self.head} refused this node's handshake: the cluster "
                    "secret differs from the head's (PARASHIFT_CLUSTER_SECRET or "
                    "--cluster-secret-file, the same on every node)")
            if self.stopping:
                raise StartupError("interrupted during start-up")
            if time.monotonic() > deadline:
                raise StartupError(f"no head node answered at {self.head} within "
                                   f"{self.args.startup_timeout:.0f} s (--data-parallel-address"
                                   f", --data-parallel-rpc-port, --startup-timeout)")
        msg = p.decode_or_drop(self.to_head.recv(), p.ToNode, "head")
        if isinstance(msg, p.Shutdown):
            raise StartupError("the head node is shutting down")
        if isinstance(msg, p.NodeRefused):
            raise StartupError(f"the head node at {self.head} refused this node: {msg.reason}")
        if msg is None or msg.config is None:
            raise StartupError(f"the head node at {self.head} answered with a message this node "
                               "cannot read (another parashift version?)")
        return msg

    def _refuse(self, reason: str) -> NoReturn:
        """The head's config cannot run here: the head hears why (for each of this node's
        ranks, which no engine has claimed yet), and this node stops."""
        node = socket.gethostname()
        reason = f"node {node}: {reason.removeprefix(f'node {node}: ')}"
        for rank in self.local_ranks:
            self.to_head.send(p.encode(p.StartupFailed(rank, reason)))
        raise StartupError(f"{reason}; this node does not start")

    def serve_forever(self) -> int:
        assert self.engines is not None  # start() made them
        poller = zmq.Poller()
        poller.register(self.to_head, zmq.POLLIN)
        poller.register(self.head_heartbeats, zmq.POLLIN)
        # The head's coordinator may still be starting: the clock runs from its first word.
        last_heard, timeout = time.monotonic(), self.args.startup_timeout
        while not self.stopping:
            for sock, _ in poller.poll(200):
                if sock is self.head_heartbeats:
                    self.head_heartbeats.recv()
                    last_heard, timeout = time.monotonic(), self.args.heartbeat_timeout
                    continue
                msg = p.decode_or_drop(self.to_head.recv(), p.ToNode, "head")
                if isinstance(msg, p.Shutdown):
                    logger.info("the head node is shutting down; stopping this node")
                    return 0
                if isinstance(msg, p.StopGroup):
                    self._stop_group(msg.engines, msg.kill)
                if isinstance(msg, p.RetireRanks) and self._retire(msg.ranks):
                    logger.info("a scale-down removed this node's last rank; stopping")
                    return 0
            if time.monotonic() - last_heard > timeout:
                logger.error("the head node has been silent for %.0f s; stopping this node",
                             timeout)
                return 1
            for death in self.engines.reap():
                logger.error("engine dp%d died: %s", death.rank, death.reason)
                self.to_head.send(p.encode(p.EngineDead(death.rank, death.reason, death.pid)))
            self.engines.restart_due()
        return 0

    def _stop_group(self, engines: list[tuple[int, int]], kill: list[int]) -> None:
        """A rank of the lockstep group died: ours of its incarnation stop now (those that
        restarted since go on), the hung ones killed."""
        logger.error("the head stops the expert-parallel group: stopping this node's engines")
        for rank, pid in engines:
            if rank in kill:
                self.engines.kill(rank, pid)
            else:
                self.engines.terminate(rank, pid)

    def _retire(self, ranks: list[int]) -> bool:
        """A scale-down removed `ranks` (of this node's); True when none is left."""
        for rank in ranks:
            if rank in self.local_ranks:
                logger.info("engine dp%d leaves (a scale-down)", rank)
                self.engines.retire(rank, self.args.shutdown_timeout)
                self.local_ranks = [r for r in self.local_ranks if r != rank]
        return not self.local_ranks

    def shutdown(self) -> None:
        if self.engines is not None:
            self.engines.stop()
        shm_files.remove(self.kv_host_tier)
        self.ctx.destroy(linger=500)


def flagged_strategy(args: EngineArgs) -> StrategySpec | None:
    """The layout this node's own flags name (--strategy, or vLLM's size flags), if any."""
    if args.strategy == "auto":  # the head's to choose
        args = dataclasses.replace(args, strategy=None)
    sizes = (args.strategy, args.data_parallel_size, args.tensor_parallel_size,
             args.pipeline_parallel_size, args.pp_layer_partition)
    if all(v is None for v in sizes) and not args.enable_expert_parallel:
        return None
    return strategy_spec(args)


def check_node(args: ServeArgs, wire: EngineConfigWire, ranks: list[int]) -> DeviceMesh:
    """The head's config against this node: the engine flags given here name the same
    values, this node's ranks fit the head's size, and it has the model's files, the devices
    and the memory to run them (this node's part of the mesh, returned). A ValueError says
    what differs, both values named."""
    check_flags(args.engine, wire)
    spec = StrategySpec.from_wire(wire.parallel.strategy)
    args.local_ranks(spec.processes().num_engines)
    config = config_for_this_node(wire)  # the model's files here, the device kind, kernels
    model, source = args.engine.model, wire.model.source
    heads = {os.path.realpath(path) for path in (config.model.path, wire.model.path, source)
             if path is not None}
    if model is not None and model != source and os.path.realpath(model) not in heads:
        raise ValueError(f"the head resolved the model {wire.model.source or 'embedded'} (here "
                         f"at {config.model.path}), this node's MODEL is {model}")
    mesh = node_mesh(spec, config.device.device, ranks)  # enough devices (cores) here
    check_memory(config, len(ranks))
    return mesh


# The engine flags a node may give, with the head's resolved value each must equal when it is
# given (not at its EngineArgs default): flag, the value in the head's config.
_RESOLVED: dict[str, tuple[str, Callable[[EngineConfigWire], Any]]] = {
    "dtype": ("--dtype", attrgetter("model.dtype")),
    "quantization": ("--quantization", attrgetter("model.quantization")),
    "max_model_len": ("--max-model-len", attrgetter("model.max_model_len")),
    "seed": ("--seed", attrgetter("model.seed")),
    "max_num_seqs": ("--max-num-seqs", attrgetter("scheduler.max_num_seqs")),
    "max_num_batched_tokens": ("--max-num-batched-tokens",
                               attrgetter("scheduler.max_num_batched_tokens")),
    "max_waiting_requests": ("--max-waiting-requests",
                             attrgetter("scheduler.max_waiting_requests")),
    "while_asleep": ("--while-asleep", attrgetter("scheduler.while_asleep")),
    "async_scheduling": ("--async-scheduling", attrgetter("scheduler.async_scheduling")),
    "prefill_schedule_interval": ("--prefill-schedule-interval",
                                  attrgetter("scheduler.prefill_schedule_interval")),
    "block_size": ("--block-size", attrgetter("cache.block_size")),
    "kv_cache_memory": ("--kv-cache-memory", attrgetter("cache.kv_cache_memory")),
    "gpu_memory_utilization": ("--gpu-memory-utilization",
                               attrgetter("cache.gpu_memory_utilization")),
    "enable_prefix_caching": ("--enable-prefix-caching",
                              attrgetter("cache.enable_prefix_caching")),
    "device": ("--device", lambda w: w.device.device.partition(":")[0]),
    "num_threads": ("--threads", attrgetter("device.num_threads")),
    "attention_backend": ("--attention-backend", attrgetter("device.attention_backend")),
    "enforce_eager": ("--enforce-eager", attrgetter("device.enforce_eager")),
    "deterministic": ("--deterministic", attrgetter("device.deterministic")),
    "cpu_kernels": ("--cpu-kernels", attrgetter("device.cpu_kernels")),
    "gemm_paths": ("--gemm-paths", lambda w: ",".join(w.device.gemm_paths)),
    "disable_shm_all_reduce": ("--disable-shm-all-reduce",
                               lambda w: not w.parallel.shm_all_reduce),
}
_DEFAULTS = EngineArgs()


def _as_resolved(name: str, value: Any, wire: EngineConfigWire) -> Any:
    """A flag's value as the head's config would hold it."""
    if name == "dtype":
        return resolve_dtype_name(value, None, "cpu")  # not "auto": an alias's full name
    if name == "gemm_paths":
        return ",".join(gemm_paths(value, wire.device.cpu_kernels))
    if name == "async_scheduling":  # never with a pipeline's batches or lockstep waves
        processes = StrategySpec.from_wire(wire.parallel.strategy).processes()
        return value and processes.max_batches_in_flight == 1 and not processes.lockstep
    return value


def check_flags(args: EngineArgs, wire: EngineConfigWire) -> None:
    """Each engine flag given on this node (a value other than its default) must be what the
    head resolved: a ValueError names the head's value and this node's."""
    own = flagged_strategy(args)
    if own is not None and msgspec.msgpack.encode(own.to_wire()) != msgspec.msgpack.encode(
            wire.parallel.strategy):
        raise ValueError(f"the head resolved the strategy {_layout(wire.parallel.strategy)}, "
                         f"this node's flags say {_layout(own.to_wire())}")
    for name, (flag, resolved) in _RESOLVED.items():
        value = getattr(args, name)
        if value == getattr(_DEFAULTS, name):
            continue
        head, here = resolved(wire), _as_resolved(name, value, wire)
        if here != head:
            raise ValueError(f"the head resolved {flag.removeprefix('--')} {head}, this node's "
                             f"{flag} is {here}")


def _layout(axes: list[StrategyAxis]) -> str:
    options = [f"{a.options}" for a in axes if a.options]
    return " ".join([str(StrategySpec.from_wire(axes)), *options])


def check_memory(config: EngineConfig, num_engines: int, memory: int | None = None) -> None:
    """On CPU every worker allocates the head's KV budget: this node's (`num_engines`
    engines') must fit in its memory (`memory` bytes; None: this machine's)."""
    if config.device.device != "cpu" or config.cache.num_gpu_blocks_override is not None:
        return
    per_worker = config.cache.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
    workers = num_engines * config.parallel.strategy.processes().workers_per_engine
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if per_worker * workers > memory:
        raise ValueError(f"the head resolved a KV cache of {per_worker / 2**30:.2f} GiB per "
                         f"worker (--kv-cache-memory): this node's {workers} workers need "
                         f"{per_worker * workers / 2**30:.2f} GiB, it has "
                         f"{memory / 2**30:.2f} GiB of memory")

"""`parashift run`: starts the API servers, the DP coordinator and this node's engine cores,
waits for every engine's READY (with a deadline that names the rank that never came up),
watches the children, and on SIGINT/SIGTERM drains, stops every child and removes the ipc
files. No orphans. Engines of other nodes (`--headless` launchers) join through the same
handshake socket, which stays open so that restarted ranks can join again."""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import time

import msgspec
import zmq

from parashift import env
from parashift.engine.args import create_config
from parashift.engine.placement import node_mesh
from parashift.engine.request_tracker import choose_eos_token_id
from parashift.kv_tiers import shm_files
from parashift.kv_tiers.disk_tier import check_private_folder
from parashift.models.gguf import DEFAULT_MODEL_NAME
from parashift.runtime import child_processes
from parashift.runtime.api_servers import ApiServers
from parashift.runtime.autoscaler import Autoscaler
from parashift.runtime.coordinator import run_coordinator
from parashift.runtime.endpoints import Endpoints, bind_listener
from parashift.runtime.handshake import Handshake
from parashift.runtime.kv_server import KVServer
from parashift.runtime.local_engines import LocalEngines, join_all
from parashift.runtime.lockstep_group import LockstepGroup
from parashift.runtime.node import ServeArgs, StartupError
from parashift.runtime.restart_policy import EngineDeath
from parashift.runtime.scale import (
    Phase,
    ScaleLimits,
    Scaler,
)
from parashift.serve.api_server import ApiServerArgs
from parashift.strategies.mesh import DeviceMesh
from parashift.types.outputs import SchedulerStats
from parashift.wire import protocol as p
from parashift.wire.cluster_auth import HeadKeys
from parashift.wire.engine_config import config_to_wire
from parashift.wire.sockets import subscriber, zmq_context

logger = logging.getLogger(__name__)

AUTOSCALER = -1  # the asker of the autoscaler's scales (not an API server: nobody to answer)


class Launcher:
    def __init__(self, args: ServeArgs):
        self.args = args
        self.config = create_config(args.engine)  # validates flags, converts a GGUF once
        self._check_pools(args)
        if self.config.cache.kv_disk_dir is not None:  # refused before any process starts
            check_private_folder(self.config.cache.kv_disk_dir)
        if self.config.cache.kv_offloading_size:
            if args.backend == "ray":  # its workers may sit on other nodes than the arena
                raise ValueError("--kv-offloading-size is not supported with --backend ray yet")
            shm_files.sweep()  # what killed launches left in /dev/shm
            # One host tier per node, shared by its engines.
            cache = dataclasses.replace(
                self.config.cache, kv_host_tier=shm_files.node_arena_path(secrets.token_hex(8)))
            self.config = dataclasses.replace(self.config, cache=cache)
        self.spec = self.config.parallel.strategy
        self.processes = self.spec.processes()  # what to launch: the strategy's answer
        self.num_engines = self.processes.num_engines  # launched
        self.local_ranks = args.local_ranks(self.num_engines)
        args.check_backend()
        self._set_up_elastic(args)
        self.lockstep: LockstepGroup | None = None
        if self.processes.lockstep:
            self.lockstep = LockstepGroup(self.num_engines)
        args.check_cluster_secret(args.backend == "ray" or args.multi_node(self.num_engines))
        self._set_up_engines(args)
        self.head_keys = HeadKeys.mint(self.capacity) if env.cluster_secret() else None
        self.ctx = zmq_context(role=self.head_keys.role(cluster=True) if self.head_keys
                               else None)
        self.handshake = Handshake(self.ctx, self.capacity, self.head_keys,
                                   self._engine_init,
                                   p.NodeInit(self.endpoints.coordinator_publish),
                                   self.engines.tokens)
        self.handshake.node_refusal = self._node_refusal
        self.coordinator: multiprocessing.Process | None = None
        self.load_in = None  # the coordinator's publications, for the scale-down's drain
        self.api_servers = ApiServers(self.ctx)
        self.ready: dict[int, p.Ready] = {}
        self.stopping = False
        self.serving = False  # start() completed
        self.listener: socket.socket | None = None
        self.kv_server: KVServer | None = None  # prefill/decode pools over nodes

    def _check_pools(self, args: ServeArgs) -> None:
        """Prefill/decode pools run with --backend mp; over nodes, with the prefill pool on
        the head (the KV server serves the head node's tier to the decode ranks elsewhere)."""
        pools = self.config.parallel.strategy.processes()
        if not pools.prefill_engines:
            return
        spec = self.config.parallel.strategy
        if args.backend == "ray":
            raise ValueError(f"--strategy {spec}: prefill/decode pools run with --backend mp "
                             "for now")
        if args.multi_node(pools.num_engines) and not set(range(pools.prefill_engines)) <= set(
                args.local_ranks(pools.num_engines)):
            raise ValueError(f"--strategy {spec}: over nodes, the prefill pool (ranks 0-"
                             f"{pools.prefill_engines - 1}) runs on the head for now: give "
                             f"--data-parallel-size-local >= {pools.prefill_engines}")

    def _set_up_engines(self, args: ServeArgs) -> None:
        """The engines' runner (Ray actors, or this node's processes on its mesh) and the
        endpoints they reach the launcher, coordinator and API servers at."""
        n = args.api_server_count
        if args.backend == "ray":  # every rank is an actor, anywhere on the cluster: tcp
            from parashift.runtime.ray_engines import RayEngines

            self.mesh = None
            self.engines = RayEngines(self.local_ranks, self.config, args.log_level,
                                      args.startup_timeout, args.ray_address, args.ray_placement,
                                      args.restart_dead_engines, self.capacity)
            # The handshake on any port (bound in start); the actors learn it as they start.
            self.endpoints = Endpoints.tcp(self.engines.node_ip, 0, n)
        else:
            self.mesh = self._node_mesh(args)
            self.endpoints = (Endpoints.tcp(args.data_parallel_address or "127.0.0.1",
                                            args.data_parallel_rpc_port, n)
                              if args.multi_node(self.num_engines) else Endpoints.local(n))
            self.engines = LocalEngines(
                {r: self.mesh.engine_placement(r) for r in self.local_ranks},
                self.endpoints.handshake, args.log_level, args.startup_timeout,
                args.restart_dead_engines)
            if not args.multi_node(self.num_engines):  # else a joining node may take them
                for rank in range(self.num_engines, self.capacity):
                    self.engines.reserve(rank)

    def _node_mesh(self, args: ServeArgs) -> DeviceMesh:
        """This node's ranks on its devices. On CPU, a single-node deployment with room to grow
        is laid out for its capacity: each rank's cores are its slice of the node split
        --data-parallel-size-max ways, so a rank a scale adds takes cores no running rank
        holds (two ranks' thread pools on one core slow both). On GPU a rank's device follows
        its number already."""
        device = self.config.device.device
        if device == "cpu" and self.capacity > self.num_engines and not args.multi_node(
                self.num_engines):
            return node_mesh(self.spec.with_size("dp", self.capacity), device,
                             list(range(self.capacity)))
        return node_mesh(self.spec, device, self.local_ranks)

    def _set_up_elastic(self, args: ServeArgs) -> None:
        """The ranks the deployment may grow to (its tables are sized for them), the scaler,
        and the autoscaler; refused where this launch cannot scale."""
        self.capacity = max(self.num_engines, args.data_parallel_size_max or 0)
        refusal = self._scale_refusal()
        self.autoscaler = Autoscaler(args.autoscale) if args.autoscale else None
        self.elastic = self.capacity > self.num_engines or self.autoscaler is not None
        if refusal and self.elastic:
            raise ValueError(f"--data-parallel-size-max/-min: {refusal}")
        if args.autoscale and not (args.autoscale.min_size <= self.num_engines
                                   <= args.autoscale.max_size):
            raise ValueError(f"--strategy {self.spec} launches {self.num_engines} rank(s), "
                             f"outside --data-parallel-size-min {args.autoscale.min_size} .. "
                             f"--data-parallel-size-max {args.autoscale.max_size}")
        if self.capacity > self.num_engines:  # engines up to the capacity are valid ranks
            self.config = dataclasses.replace(self.config, parallel=dataclasses.replace(
                self.config.parallel, strategy=self.spec.with_size("dp", self.capacity)))
        self.scaler = Scaler(ScaleLimits(self.capacity, args.startup_timeout,
                                         args.drain_timeout, refusal),
                             self.num_engines, lambda n: self.engines.room(n))
        self.loads: dict[int, tuple[float, p.EngineLoad]] = {}  # the coordinator's, heard
        self.pending_scales: collections.deque[tuple[int, p.ScaleRequest]] = collections.deque()

    @property
    def model_name(self) -> str:
        if self.args.served_model_name:
            return self.args.served_model_name
        if self.args.engine.model is None:
            return DEFAULT_MODEL_NAME
        return os.path.basename(self.args.engine.model.rstrip("/")).removesuffix(".gguf")

    def url(self) -> str:
        host = f"[{self.args.host}]" if ":" in self.args.host else self.args.host
        port = self.listener.getsockname()[1] if self.listener else self.args.port  # --port 0
        return f"http://{host}:{port}"

    def banner(self) -> str:
        return f"parashift is serving {self.model_name!r} at {self.url()}/v1"

    def start(self) -> None:
        self._log_layout()
        mp = child_processes.context()
        self.listener = bind_listener(self.args.host, self.args.port)
        logger.info("HTTP listens at %s; it answers once every engine is ready", self.url())
        self._bind_handshake()
        if self.lockstep is not None:  # its store, before any engine asks where it is
            self.lockstep.open(self.ctx, self.endpoints.expert_store)
            if self.lockstep.address.startswith("tcp://"):
                logger.info("the expert group's store listens at %s", self.lockstep.address)
        if self.processes.prefill_engines and self.endpoints.handshake.startswith("tcp://"):
            self._start_kv_server()
        coordinator_pub = self._start_coordinator(mp)
        self._start_api_servers(mp, coordinator_pub)
        self.engines.start()
        self._wait_engines_ready()
        # Engines are up; the URL is printed only once every API server has seen them.
        self.api_servers.wait_ready(self.args.startup_timeout, self._check_starting)
        self.serving = True

    def _log_layout(self) -> None:
        if self.mesh is not None:
            later = [r for r in self.mesh.engines or () if r >= self.num_engines]
            grows = f" (dp{', dp'.join(map(str, later))} once scaled up)" if later else ""
            logger.info("strategy %s; this node runs%s:\n%s", self.spec, grows,
                        self.mesh.table())
        else:
            logger.info("strategy %s on Ray: one placement group per rank, bundles %s",
                        self.spec, self.engines.bundles)

    def _bind_handshake(self) -> None:
        try:
            self.endpoints.handshake = self.handshake.bind(self.endpoints.handshake)
            self.engines.handshake_address = self.endpoints.handshake  # port 0: the bound one
            if self.endpoints.handshake.startswith("tcp://"):  # headless nodes join there
                logger.info("the handshake listens at %s", self.endpoints.handshake)
        except zmq.ZMQError as e:
            raise StartupError(f"cannot bind the handshake at {self.endpoints.handshake} "
                               f"(--data-parallel-address/--data-parallel-rpc-port): {e}") from e

    def _start_kv_server(self) -> None:
        """Pools over nodes: the decode ranks elsewhere fetch the prompts' blocks here."""
        self.kv_server = KVServer(self.ctx, self.args.data_parallel_address or "127.0.0.1",
                                  self.config.cache.kv_host_tier)
        self.kv_server.start()
        logger.info("the KV server listens at %s", self.kv_server.address)

    def _start_coordinator(self, mp) -> str | None:
        """The DP coordinator (dp > 1, or room to grow); its PUB address."""
        if not (self.processes.coordinator or self.capacity > 1):
            return None
        self.coordinator = mp.Process(
            target=run_coordinator, name="parashift-dp-coordinator",
            args=(self.capacity, self.endpoints.coordinator_load,
                  self.endpoints.coordinator_publish, self.args.heartbeat_timeout,
                  self.args.log_level, self.endpoints.handed(
                      self.endpoints.coordinator_load, self.endpoints.coordinator_publish),
                  self.head_keys))
        self.coordinator.start()
        coordinator_pub = self.endpoints.coordinator_publish
        self.handshake.watch(coordinator_pub)
        if self.elastic:
            self.load_in = subscriber(self.ctx, coordinator_pub)
        if self.lockstep is not None:
            self.lockstep.watch(self.ctx, coordinator_pub)
        return coordinator_pub

    def _start_api_servers(self, mp, coordinator_pub: str | None) -> None:
        mc = self.config.model
        eos = choose_eos_token_id(mc.hf_config)
        for i in range(self.args.api_server_count):
            server_args = ApiServerArgs(
                i, self.endpoints.requests[i], self.endpoints.outputs[i], self.capacity,
                mc.tokenizer_path, self.model_name, mc.max_model_len,
                eos, mc.vocab_size, self.args.api_key,
                self.args.log_level, coordinator_pub, self.args.request_timeout,
                routing=self.args.routing, bound=self.endpoints.handed(
                    self.endpoints.requests[i], self.endpoints.outputs[i]),
                max_body_bytes=self.args.max_body_bytes,
                tool_call_parser=self.args.tool_call_parser, head_keys=self.head_keys,
                launcher_identity=self.api_servers.identity, limits=self.args.limits,
                size=self.num_engines, prefill_engines=self.processes.prefill_engines)
            self.api_servers.start(mp, server_args, self.listener,
                                   self.mesh.api_server_cpus if self.mesh is not None else ())

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

    def _check_starting(self) -> None:
        self._check_children_alive()
        if self.stopping:
            raise StartupError("interrupted during start-up")

    def _serve_handshake(self, timeout_ms: int, starting: bool = False) -> None:
        """Engines (first start, restarts, other nodes) and headless launchers."""
        msg = self.handshake.receive(timeout_ms)
        if isinstance(msg, p.Ready):
            again = msg.rank in self.ready
            self.ready[msg.rank] = msg
            if self.lockstep is not None:
                self.lockstep.on_ready(msg.rank, self.handshake.claims.get(msg.rank, (b"", 0))[1])
            logger.info("engine dp%d %s: %d KV blocks of %d tokens, max_model_len %d, weight "
                        "bytes per worker %s", msg.rank, "ready again" if again else "ready",
                        msg.num_blocks, msg.block_size, msg.max_model_len, msg.weight_bytes)
            if not starting:
                self._joined(msg.rank)
        elif isinstance(msg, p.StartupFailed):
            if starting:
                raise StartupError(f"engine dp{msg.rank} failed to start: {msg.error}")
            logger.error("engine dp%d failed to start again: %s", msg.rank, msg.error)
        elif isinstance(msg, p.EngineDead):  # a headless launcher saw one of its ranks die
            if starting:
                raise StartupError(f"engine dp{msg.rank} died during start-up: {msg.reason}")
            self._announce_dead(msg)
            self._group_died(msg.rank)

    def _engine_init(self, rank: int) -> p.EngineInit:
        group = self.lockstep
        config = self.config.for_engine(rank, self.args.backend,
                                        group.address if group else None)
        remote = rank not in self.local_ranks  # (another node's: its own host tier)
        if remote and config.cache.kv_host_tier is not None:
            config = dataclasses.replace(config, cache=dataclasses.replace(
                config.cache, kv_host_tier=shm_files.headless_arena_path(
                    config.cache.kv_host_tier)))
        return p.EngineInit(config_to_wire(config), self.endpoints.requests,
                            self.endpoints.outputs,
                            self.endpoints.coordinator_load if self.coordinator else None,
                            self.endpoints.coordinator_publish if group else None,
                            kv_server=self.kv_server.address if self.kv_server and remote
                            else None)

    def _announce_dead(self, death: p.EngineDead) -> None:
        logger.error("engine dp%d died: %s", death.rank, death.reason)
        self.handshake.release(death.rank)
        self.api_servers.announce(death)

    def _check_children_alive(self) -> None:
        if self.coordinator is not None and self.coordinator.exitcode is not None:
            raise StartupError(f"the DP coordinator exited with code {self.coordinator.exitcode}")
        self.api_servers.check_alive()

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
            self._hear_hung_group_ranks()
            for death in self.engines.reap():
                if self._scale_up_failed(death):
                    continue
                self._announce_dead(p.EngineDead(death.rank, death.reason, death.pid))
                self._group_died(death.rank)
            self.engines.restart_due()
            self._serve_handshake(200)
            self._serve_api_servers()
            self._hear_loads()
            self._advance_scale()
            self._autoscale()
        return 0

    # --- the expert-parallel lockstep group (runtime/lockstep_group.py) -----------------------
    def _hear_hung_group_ranks(self) -> None:
        """The coordinator's verdicts on the group's silent ranks: this node's processes and
        Ray actors are killed (the death then stops the group); another node's stop the
        group now, and their node kills them. A verdict names the engine's pid: one about an
        earlier process of the rank kills nothing (the new one may be loading)."""
        if self.lockstep is None:
            return
        for rank, pid in self.lockstep.hung_ranks():
            if self.mesh is not None and rank in self.local_ranks:
                self.engines.kill(rank, pid)  # it checks the pid against its process
            elif pid != self.lockstep.pids.get(rank):
                continue
            elif self.mesh is None:  # Ray
                self.engines.kill(rank, pid)
            else:
                self._group_died(rank, hung=pid)

    def _group_died(self, rank: int, hung: int | None = None) -> None:
        """A rank of the group died (or hung elsewhere: `hung`, its pid): every other rank
        stops at once, on this node and on the others (every engine that said Hello for the
        broken incarnation, loading or ready), and they meet again at a new store as they
        restart."""
        if self.lockstep is None:
            return
        engines = {r: pid for r, (_, pid) in self.handshake.claims.items()}
        if hung is not None:
            engines[rank] = hung
        if self.lockstep.on_death(rank):
            self.engines.stop_all()  # reaped (and restarted) on the next turns
            self.handshake.stop_group(engines, [rank] if hung is not None else [])

    # --- elastic data parallel (runtime/scale.py) ---------------------------------------------
    def _scale_refusal(self) -> str:
        """Why this launch cannot change its size ("" when it can)."""
        if self.processes.lockstep:
            return (f"--strategy {self.spec}: expert-parallel lockstep groups do not scale "
                    "(elastic expert parallel, with expert re-sharding, is later work)")
        if self.processes.prefill_engines:
            return (f"--strategy {self.spec}: prefill/decode pools do not scale yet (a pool's "
                    "size is fixed at launch)")
        return ""

    def _node_refusal(self, ranks: range) -> str:
        """Why a headless node may not take `ranks` now: one that joins a running head (a
        scale-up by hand, on another node) takes the ranks right after the current size."""
        size = self.scaler.size
        if ranks.stop <= size:  # its place in the launch, or its ranks again after a restart
            return ""
        if self.scaler.job is not None:
            return f"a scale to {self.scaler.job.target} is in progress"
        if ranks.start != size:
            return (f"a node that joins takes the ranks from dp{size}, the current size "
                    f"(--data-parallel-start-rank {size})")
        return ""

    def _joined(self, rank: int) -> None:
        """A headless node's engine beyond the size became ready: the size grows over the
        ranks ready from it on (a node joins with consecutive ranks)."""
        if self.scaler.job is not None or rank < self.scaler.size:
            return
        size = self.scaler.size
        while size in self.ready:
            size += 1
        if size > self.scaler.size:
            logger.info("a headless node's ranks joined: data parallel size %d -> %d",
                        self.scaler.size, size)
            self.scaler.size = size

    def _serve_api_servers(self) -> None:
        for index, control in enumerate(self.api_servers.controls):
            while control.poll(0):
                msg = p.decode_or_drop(control.recv(), p.FromApiServer, "api-server control")
                job = self.scaler.job
                if isinstance(msg, p.ScaleRequest):
                    self._begin_scale(index, msg)
                elif (isinstance(msg, p.RankRemovedSeen) and job is not None
                      and msg.rank in job.ranks):
                    job.seen.add((index, msg.rank))

    def _answer_scale(self, index: int, result: p.ScaleResult) -> None:
        if index == AUTOSCALER:
            if result.error:
                logger.warning("the autoscaler's scale did not happen: %s", result.error)
            return
        try:
            self.api_servers.controls[index].send(p.encode(result), zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.warning("could not answer API server %d's scale request: %s", index, e)

    def _begin_scale(self, index: int, msg: p.ScaleRequest) -> None:
        if self.scaler.job is not None:  # one at a time, in order (the autoscaler's: dropped)
            if index != AUTOSCALER:
                self.pending_scales.append((index, msg))
            return
        refused = self.scaler.refuse(msg)
        if refused is not None:
            self._answer_scale(index, refused)
            return
        job = self.scaler.begin(msgspec.structs.replace(msg, index=index))
        if job.phase == Phase.STARTING:
            mesh = self.mesh  # Ray (None): each actor its own
            if mesh is not None and not set(job.ranks) <= set(mesh.engines or ()):
                mesh = node_mesh(self.spec.with_size("dp", job.target),
                                 self.config.device.device, job.ranks)
            for rank in job.ranks:
                self.ready.pop(rank, None)
                self.engines.add(rank, mesh.engine_placement(rank) if mesh else None)
            return
        for rank in job.ranks:
            self.api_servers.announce(p.RankDraining(rank))

    def _autoscale(self) -> None:
        if self.autoscaler is None or self.scaler.job is not None:
            return
        size = self.scaler.size
        decision = self.autoscaler.decide(time.monotonic(), size, {
            rank: load for rank, (_, load) in self.loads.items() if rank < size})
        if decision is None:
            return
        logger.info("autoscaler: data parallel %d -> %d: %s", size, decision.size,
                    decision.reason)
        self.autoscaler.restart_windows()
        self._begin_scale(AUTOSCALER, p.ScaleRequest(AUTOSCALER, 0, decision.size))

    def _advance_scale(self) -> None:
        job = self.scaler.job
        if job is None:
            if self.pending_scales:
                self._begin_scale(*self.pending_scales.popleft())
            return
        if job.phase == Phase.STARTING:
            if all(rank in self.ready for rank in job.ranks):
                self.local_ranks = sorted({*self.local_ranks, *job.ranks})
                self._answer_scale(*self.scaler.finish())
            elif self.scaler.overdue():
                missing = ", ".join(f"dp{r}" for r in job.ranks if r not in self.ready)
                self._fail_scale_up(f"engine {missing} did not become ready within "
                                    f"{self.args.startup_timeout:.0f} s (--startup-timeout)")
            return
        if job.phase == Phase.REMOVING:
            if self.scaler.removed(len(self.api_servers.controls)):
                self._remove_ranks(job.ranks)
                self._answer_scale(*self.scaler.finish())
            return
        gone = {r: (0.0, p.EngineLoad(r, SchedulerStats(0, 0, 0.0)))  # dead: nothing to drain
                for r in job.ranks if r not in self.handshake.claims}
        overdue = self.scaler.overdue()
        if not (overdue or self.scaler.drained({**self.loads, **gone})
                or len(gone) == len(job.ranks)):
            return
        reason = (f"its rank was removed by a scale-down to {job.target} (--drain-timeout "
                  f"{self.args.drain_timeout:g} s passed)" if overdue
                  else f"its rank was removed by a scale-down to {job.target}")
        for rank in job.ranks:
            self.api_servers.announce(p.RankRemoved(rank, reason))
        self.scaler.removing()  # the processes stop once the API servers let them go

    def _remove_ranks(self, ranks: list[int]) -> None:
        """Their processes stop: this node's here, a headless node's there (told to)."""
        self.handshake.retire_node_ranks(ranks)
        multi_node = self.args.multi_node(self.num_engines)
        for rank in ranks:
            self.engines.retire(rank, self.args.shutdown_timeout, reserve=not multi_node)
            self.handshake.release(rank)
            self.ready.pop(rank, None)
            self.loads.pop(rank, None)
        self.local_ranks = [r for r in self.local_ranks if r not in ranks]

    def _scale_up_failed(self, death: EngineDeath) -> bool:
        """A rank a scale-up starts died before it was ready: the scale fails."""
        job = self.scaler.job
        if job is None or job.phase != Phase.STARTING or death.rank not in job.ranks:
            return False
        self._fail_scale_up(f"engine dp{death.rank} {death.reason} while starting")
        return True

    def _fail_scale_up(self, error: str) -> None:
        job = self.scaler.job
        for rank in job.ranks:
            if rank in self.ready:  # it told the API servers it serves
                self.api_servers.announce(p.RankRemoved(rank, f"a failed scale-up: {error}"))
        self._remove_ranks(job.ranks)
        self._answer_scale(*self.scaler.finish(error, 503))

    def _hear_loads(self) -> None:
        """The coordinator's latest load of each rank, with when it was heard."""
        while self.load_in is not None and self.load_in.poll(0):
            msg = p.decode_or_drop(self.load_in.recv(), p.FromCoordinator, "loads")
            if isinstance(msg, p.LoadVector):
                now = time.monotonic()
                self.loads.update((load.rank, (now, load)) for load in msg.loads)

    def shutdown(self) -> None:
        timeout = self.args.shutdown_timeout
        self.api_servers.ask_to_drain(timeout)
        self.handshake.shut_down_nodes(timeout)
        # A start-up that failed has nothing to drain, and a child stuck in its own start (an
        # engine hung in its load ignores SIGTERM) would only be waited for: a short grace,
        # then the kill.
        grace = None if self.serving else 2.0
        self.api_servers.join(grace or timeout + 5)
        # The coordinator goes before the engines: with no API server left it has nobody to
        # tell, and one engine exiting seconds before another must not be declared dead.
        if self.coordinator is not None:
            self.coordinator.terminate()
            join_all([self.coordinator], 10)
        self.engines.stop(grace or 10.0)
        if self.kv_server is not None:
            self.kv_server.stop()
        if self.lockstep is not None:
            self.lockstep.close()
        shm_files.remove(self.config.cache.kv_host_tier)
        if self.listener is not None:
            self.listener.close()
        self.ctx.destroy(linger=500 if self.handshake.nodes else 0)
        self.endpoints.remove()


def run(args: ServeArgs) -> int:
    child_processes.build_cpu_kernels_early(args.engine)
    if args.headless:
        from parashift.runtime.headless import HeadlessLauncher

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
        # One write, newline included: unbuffered (PYTHONUNBUFFERED), print's two writes let a
        # child's log line land inside the banner's line on a shared pipe.
        sys.stdout.write(launcher.banner() + "\n")
        sys.stdout.flush()
        code = launcher.serve_forever()
    except StartupError as e:
        logger.error("%s", e)
        code = 1
    finally:
        launcher.shutdown()
    return code

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
import secrets
import signal
import socket
import sys
import time

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
from parashift.runtime.coordinator import run_coordinator
from parashift.runtime.elastic_launch import ElasticLaunch
from parashift.runtime.endpoints import Endpoints, bind_listener
from parashift.runtime.handshake import Handshake
from parashift.runtime.kv_server import KVServer
from parashift.runtime.local_engines import LocalEngines, join_all
from parashift.runtime.lockstep_group import LockstepGroup
from parashift.runtime.node import ServeArgs, StartupError
from parashift.serve.api_server import ApiServerArgs
from parashift.strategies.mesh import DeviceMesh
from parashift.wire import protocol as p
from parashift.wire.cluster_auth import HeadKeys
from parashift.wire.engine_config import config_to_wire
from parashift.wire.sockets import subscriber, zmq_context

logger = logging.getLogger(__name__)



class Launcher(ElasticLaunch):
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

"""`parashift run --headless`: a node that runs only engine cores (ranks start .. start +
local - 1) for a head node elsewhere. Its engines join the head's handshake over TCP like
local ones; this launcher introduces itself to the head, reports its engines' deaths there
(and restarts them when asked), and stops when the head says so -- or when the head's
coordinator has been silent for --heartbeat-timeout, so that a dead head leaves no engines
behind on other nodes."""

from __future__ import annotations

import logging
import time

import zmq

from parashift.engine.args import create_config
from parashift.engine.placement import node_mesh
from parashift.runtime.local_engines import LocalEngines
from parashift.runtime.node import ServeArgs, StartupError
from parashift.wire import protocol as p
from parashift.wire.cluster_auth import handshake_failed
from parashift.wire.sockets import routing_id, subscriber, tcp_url, zmq_context

logger = logging.getLogger(__name__)


class HeadlessLauncher:
    def __init__(self, args: ServeArgs):
        self.args = args
        self.config = create_config(args.engine)  # validates flags, converts a GGUF once
        spec = self.config.parallel.strategy
        self.local_ranks = args.local_ranks(spec.processes().num_engines)
        args.check_backend()  # --backend ray places ranks itself: no headless nodes
        args.check_cluster_secret(tcp=True)
        self.head = tcp_url(args.data_parallel_address or "127.0.0.1",
                            args.data_parallel_rpc_port)
        self.mesh = node_mesh(spec, self.config.device.device, self.local_ranks)
        self.engines = LocalEngines(
            {r: self.mesh.engine_placement(r) for r in self.local_ranks}, self.head,
            args.log_level, args.startup_timeout, args.restart_dead_engines)
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
        logger.info("headless node: engines %s, head at %s; this node runs:\n%s",
                    ", ".join(f"dp{r}" for r in self.local_ranks), self.head, self.mesh.table())
        monitor = self.to_head.get_monitor_socket()
        self.to_head.connect(self.head)
        self.to_head.send(p.encode(p.NodeHello(self.local_ranks[0], len(self.local_ranks))))
        self.engines.start()
        deadline = time.monotonic() + self.args.startup_timeout
        while not self.to_head.poll(200):
            if handshake_failed(monitor):
                raise StartupError(
                    f"the head node at {self.head} refused this node's handshake: the cluster "
                    "secret differs from the head's (PARASHIFT_CLUSTER_SECRET or "
                    "--cluster-secret-file, the same on every node)")
            if self.stopping:
                raise StartupError("interrupted during start-up")
            for death in self.engines.reap():
                raise StartupError(f"engine dp{death.rank} {death.reason} during start-up")
            if time.monotonic() > deadline:
                raise StartupError(f"no head node answered at {self.head} within "
                                   f"{self.args.startup_timeout:.0f} s (--data-parallel-address"
                                   f", --data-parallel-rpc-port, --startup-timeout)")
        msg = p.decode_or_drop(self.to_head.recv(), p.ToNode, "head")
        if msg is None:
            raise StartupError(f"the head node at {self.head} answered with a message this node "
                               "cannot read (another parashift version?)")
        if isinstance(msg, p.Shutdown):
            raise StartupError("the head node is shutting down")
        self.head_heartbeats = subscriber(self.ctx, msg.coordinator_publish_address)

    def serve_forever(self) -> int:
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
                elif isinstance(p.decode_or_drop(self.to_head.recv(), p.ToNode, "head"),
                                p.Shutdown):
                    logger.info("the head node is shutting down; stopping this node")
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

    def shutdown(self) -> None:
        self.engines.stop()
        self.ctx.destroy(linger=500)

"""The workers of an engine under `--backend ray` (MultiprocExecutor's `workers`): each is a
Ray actor in bundle 1 + its index of the engine's placement group. The mesh names and orders
the workers; Ray picks their devices. Everything else is MultiprocExecutor's (ZMQ step
commands over tcp, collective_rpc, the output rank answers). The torch.distributed rendezvous
is a TCP store that worker 0 hosts on its node's address alone (loopback when the engine's
placement group is strictly packed on one node), so workers may sit on different nodes.
The step links are CURVE with keys this engine mints per worker (wire/cluster_auth.py
WorkerKeys): only worker i takes worker i's commands, and only the workers send results."""

from __future__ import annotations

import dataclasses
import logging

import zmq

from parashift import env
from parashift.config import EngineConfig
from parashift.executor.multiproc import WorkerDiedError
from parashift.executor.worker_process import WorkerArgs, run_worker
from parashift.processes import named_actor_class
from parashift.strategies.mesh import EnginePlacement
from parashift.wire.cluster_auth import WorkerKeys, worker_principal
from parashift.wire.sockets import listen_tcp, tcp_url, zmq_context

logger = logging.getLogger(__name__)


class _WorkerActor:
    """One worker of the engine (made a Ray actor class in RayExecutor)."""

    def open_store(self, host: str) -> str:
        """Worker 0 only: bind its rendezvous store's socket on `host` at a port the kernel
        picks, and keep it for `run` (torch's TCPStore alone would listen on every interface,
        and a port picked then released can be taken in between)."""
        self.store_listener = listen_tcp(host, 0, 256)
        return tcp_url(host, self.store_listener.getsockname()[1])

    def run(self, args: WorkerArgs, cluster_secret: str | None) -> None:
        if cluster_secret is not None:  # before any socket: the engine's links are CURVE
            env.set_cluster_secret(cluster_secret)
        listener = getattr(self, "store_listener", None)
        if listener is not None:
            args = dataclasses.replace(args, store_listen_fd=listener.detach())
        run_worker(args)


class RayWorkers:
    """An engine's workers as Ray actors (MultiprocExecutor's `workers`), tcp sockets."""

    def __init__(self, config: EngineConfig, placement: EnginePlacement, log_level: str):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError("the Ray executor runs inside an engine actor's placement group")
        gpu = config.device.device != "cpu"
        # Inside its actor a worker sees the one GPU Ray gave it, and no core set of ours.
        workers = [dataclasses.replace(w, cpu_ids=(), cuda_index=0 if gpu else None)
                   for w in placement.workers]
        self.actors = [ray.remote(named_actor_class(_WorkerActor, w.process_name))
                       .options(name=w.process_name, num_cpus=0 if gpu else 1,
                                num_gpus=1 if gpu else 0,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(
                                    pg, placement_group_bundle_index=1 + w.local_rank)).remote()
                       for w in workers]
        # A strictly packed group (--ray-placement pack) is one node's: its links, the store
        # and gloo's pairs stay on loopback. Spread over nodes, they use this node's address.
        one_node = ray.util.placement_group_table(pg).get("strategy") == "STRICT_PACK"
        my_ip = "127.0.0.1" if one_node else ray.util.get_node_ip_address()
        if not one_node and len(workers) > 1:
            logger.warning("this engine's workers may sit on several nodes (--ray-placement "
                           "spread): their torch.distributed store and gloo/NCCL links are "
                           "not authenticated; keep the nodes on a private network")
        store = ray.get(self.actors[0].open_store.remote(my_ip))
        keys = WorkerKeys.mint(len(workers)) if env.cluster_secret() else None
        self.ctx, self.results, self.commands = worker_links(keys, len(workers), my_ip)
        result_address = self.results.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.names = [w.process_name for w in workers]
        self.refs = []
        for i, (worker, actor) in enumerate(zip(workers, self.actors, strict=True)):
            key = keys.workers[i] if keys else None
            args = WorkerArgs(config, worker, store,
                              self.commands[i].getsockopt(zmq.LAST_ENDPOINT).decode(),
                              result_address, log_level,
                              link_key=(key.public, key.secret) if key else None)
            self.refs.append(actor.run.remote(args, env.cluster_secret()))

    def check_health(self) -> None:
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in done:
            rank = self.refs.index(ref)
            try:
                ray.get(ref)
                reason = "returned"
            except Exception as e:  # RayActorError, a worker's exception
                reason = str(e).splitlines()[0][:200]
            raise WorkerDiedError(f"worker {self.names[rank]} (Ray actor) stopped: {reason}")

    def alive(self) -> bool:
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return not done

    def cleanup_call(self) -> tuple:
        return _kill_actors, self.actors, self.ctx


def worker_links(keys: WorkerKeys | None, num_workers: int, host: str
                 ) -> tuple[zmq.Context, zmq.Socket, list[zmq.Socket]]:
    """The engine's sockets to its workers on tcp `host`, at ports the kernel picks: the
    results PULL, which admits every worker's key, and one command PUSH per worker, which
    admits its worker's only (over CURVE: with `keys`, and the cluster secret)."""
    ctx = zmq_context(role=keys.role() if keys else None)
    results = ctx.socket(zmq.PULL)
    results.bind_to_random_port(f"tcp://{host}")
    commands = []
    for i in range(num_workers):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ZAP_DOMAIN, worker_principal(i).encode())
        sock.bind_to_random_port(f"tcp://{host}")
        commands.append(sock)
    return ctx, results, commands


def _kill_actors(actors: list, ctx: zmq.Context) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor)
        except Exception as e:  # already gone
            logger.debug("ray.kill: %s", e)
    ctx.destroy(linger=0)

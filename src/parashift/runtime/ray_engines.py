"""`parashift run --backend ray`: the engine cores (and their tp workers) as Ray actors, one
placement group per data-parallel rank -- bundle 0 for the engine core, bundles 1..tp for the
workers (tp1: the engine core runs the model in bundle 0). Same interface as LocalEngines, so
the launcher, API servers and coordinator stay on this (the head) node unchanged; the
engines join the launcher's handshake over TCP, its address travelling in the actor call.
A cluster too small for the strategy is refused at once, naming what is missing.

A scale-up (`add`) asks for one more placement group without waiting for it: the actor starts
once Ray places the group, and a group still unplaced after PLACEMENT_TIMEOUT_S is reported by
`reap` as the rank's death (no node has room), which fails the scale. The cluster's placement
is the memory and CPU check here: the rank may land on another node."""

from __future__ import annotations

import logging
import secrets
import time

from parashift import env
from parashift.config import EngineConfig
from parashift.processes import named_actor_class
from parashift.runtime.ray_cluster import (
    RayStartupError,
    bundle_totals,
    check_capacity,
    connect,
    rank_bundles,
)
from parashift.runtime.restart_policy import EngineDeath, RestartPolicy
from parashift.strategies.mesh import engine_process_name

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 30.0


class _EngineActor:
    """An engine core (made a Ray actor class in RayEngines)."""

    def run(self, rank: int, handshake_address: str, log_level: str, timeout: float,
            cluster_secret: str, token: bytes) -> None:
        from parashift import env
        from parashift.engine.engine_process import run_engine

        env.set_cluster_secret(cluster_secret)  # before any socket: its links are CURVE
        run_engine(rank, handshake_address, log_level, None, timeout, token)


class RayEngines:
    def __init__(self, ranks: list[int], config: EngineConfig, log_level: str,
                 handshake_timeout: float, address: str | None = None, placement: str = "pack",
                 restart: bool = False, capacity: int = 0):
        """`capacity`: the most ranks this launch may scale to (a local cluster it starts is
        sized for them)."""
        self.restarts = RestartPolicy(restart)
        self.ranks = ranks
        self.tokens = {rank: secrets.token_bytes(16) for rank in ranks}  # for each Hello
        self.handshake_address = ""  # the launcher's, once it knows this node's address
        self.log_level = log_level
        self.handshake_timeout = handshake_timeout
        self.placement = placement
        spec = config.parallel.strategy
        self.bundles = rank_bundles(spec.processes(), config.device.device != "cpu")
        self.started_cluster = connect(address, self.bundles, max(capacity, len(ranks)))
        import ray

        try:
            check_capacity(str(spec), self.bundles, len(ranks))
        except RayStartupError:
            ray.shutdown()  # a local instance stops; from a cluster we only disconnect
            raise
        self.node_ip = ray.util.get_node_ip_address()
        self.groups: dict[int, object] = {}
        self.actors: dict[int, object] = {}
        self.refs: dict[int, object] = {}
        self.placing: dict[int, float] = {}  # a scale-up's rank -> when its group was asked

    @property
    def _group_strategy(self) -> str:
        return "STRICT_PACK" if self.placement == "pack" else "SPREAD"

    def _unplaced(self, rank: int) -> str:
        return (f"the placement group of dp{rank} ({self.bundles}, {self._group_strategy}) "
                f"was not placed within {PLACEMENT_TIMEOUT_S:.0f} s: no node has room")

    def start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group

        from parashift.runtime.ray_nodes import alive_nodes, place

        # DP ranks spread over the nodes (the same choice `plan --backend ray` shows).
        targets = place(alive_nodes(ray), self.bundles, len(self.ranks))
        for rank, target in zip(self.ranks, targets, strict=True):
            self.groups[rank] = placement_group(self.bundles, strategy=self._group_strategy,
                                                name=f"parashift-dp{rank}",
                                                _soft_target_node_id=target.node_id)
        for rank, group in self.groups.items():
            try:
                ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise RayStartupError(self._unplaced(rank)) from None
            self._spawn(rank)

    def add(self, rank: int, placement: object = None) -> None:
        """A new rank (a scale-up), with a fresh token its Hello must carry, in a placement
        group of its own wherever Ray finds room (`placement`, the mp mesh's, is unused)."""
        from ray.util.placement_group import placement_group

        self.ranks = sorted({*self.ranks, rank})
        self.tokens[rank] = secrets.token_bytes(16)
        self.groups[rank] = placement_group(self.bundles, strategy=self._group_strategy,
                                            name=f"parashift-dp{rank}")
        self.placing[rank] = time.monotonic()
        self._spawn(rank)

    def retire(self, rank: int, timeout: float = 10.0, reserve: bool = True) -> None:
        """The rank leaves (a scale-down, or a failed scale-up): its actor is killed and its
        placement group removed (Ray frees their resources); `reap` does not report it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self.restarts.forget(rank)
        ref = self.refs.pop(rank, None)
        self.placing.pop(rank, None)
        actor, group = self.actors.pop(rank, None), self.groups.pop(rank, None)
        if actor is not None:
            try:
                ray.kill(actor)
            except Exception as e:  # already gone
                logger.debug("ray.kill: %s", e)
            if ref is not None:  # its run ends once the cluster knows the actor is dead
                ray.wait([ref], timeout=timeout)
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception as e:
                logger.debug("remove_placement_group: %s", e)
        if reserve:
            self.reserve(rank)
        else:
            self.tokens.pop(rank, None)
        self.ranks = [r for r in self.ranks if r != rank]

    def reserve(self, rank: int) -> None:
        """A rank this launcher may start later: a token nobody holds (LocalEngines.reserve)."""
        self.tokens[rank] = secrets.token_bytes(16)

    def room(self, n: int) -> str:
        """Why n more ranks would not fit the cluster's free CPUs and GPUs ("" if they may:
        the placement, on one node per group, has the last word)."""
        import ray

        free = ray.available_resources()
        need = bundle_totals(self.bundles, n)
        if all(v <= free.get(k, 0.0) + 1e-9 for k, v in need.items()):
            return ""
        return (f"{n} more rank(s) need {need['CPU']:g} CPUs and {need['GPU']:g} GPUs "
                f"(bundles {self.bundles} each); the Ray cluster has "
                f"{free.get('CPU', 0.0):g} CPUs and {free.get('GPU', 0.0):g} GPUs free")

    def restart_due(self) -> None:
        for rank in self.restarts.due():
            self._spawn(rank)

    def _spawn(self, rank: int) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[0]
        name = engine_process_name(rank)
        actor = ray.remote(named_actor_class(_EngineActor, name)).options(
            name=name, num_cpus=bundle.get("CPU", 0.0),
            num_gpus=bundle.get("GPU", 0.0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.groups[rank], placement_group_bundle_index=0,
                placement_group_capture_child_tasks=True)).remote()
        self.actors[rank] = actor
        self.refs[rank] = actor.run.remote(rank, self.handshake_address, self.log_level,
                                           self.handshake_timeout, env.cluster_secret(),
                                           self.tokens[rank])
        self.restarts.started(rank)

    def reap(self) -> list[EngineDeath]:
        import ray

        deaths = self._reap_unplaced()
        if not self.refs:
            return deaths
        refs = list(self.refs.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for rank, ref in list(self.refs.items()):
            if ref not in done:
                continue
            del self.refs[rank]
            try:
                ray.get(ref)
                reason = "the engine actor returned"
            except Exception as e:  # RayActorError when killed, the engine's own error
                reason = f"Ray actor died: {str(e).splitlines()[0][:200]}"
            deaths.append(EngineDeath(rank, 0, reason))
            self.restarts.died(rank)
        return deaths

    def kill(self, rank: int, incarnation: int) -> None:
        """Kill rank's actor, hung (the launcher checked that the verdict names its engine)."""
        import ray

        actor = self.actors.get(rank)
        if actor is not None and rank in self.refs:
            logger.error("engine dp%d is hung (pid %d): killing its actor", rank, incarnation)
            ray.kill(actor, no_restart=True)

    def stop_all(self) -> None:
        """Kill every live engine actor without waiting (a lockstep group stops at once):
        `reap` sees them go, and they restart as any death."""
        import ray

        for rank in list(self.refs):
            ray.kill(self.actors[rank], no_restart=True)

    def _reap_unplaced(self) -> list[EngineDeath]:
        """A scale-up's rank whose group Ray has not placed in time: dead, with the reason."""
        deaths = []
        for rank, since in list(self.placing.items()):
            if self.groups[rank].wait(0):
                del self.placing[rank]
            elif time.monotonic() - since > PLACEMENT_TIMEOUT_S:
                del self.placing[rank]
                self.refs.pop(rank, None)
                deaths.append(EngineDeath(rank, 0, self._unplaced(rank)))
        return deaths

    def stop(self, timeout: float = 10.0) -> None:
        import ray

        if not ray.is_initialized():
            return
        for rank in sorted({*self.actors, *self.groups}):
            self.retire(rank, timeout, reserve=False)
        if self.started_cluster:
            ray.shutdown()

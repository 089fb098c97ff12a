"""The head launcher's elastic data parallel (runtime/scale.py: the scaler's phases;
runtime/autoscaler.py): ranks added and removed while serving, asked by an API server's
/scale_elastic_ep, by the autoscaler, or by a headless node that joins. A mixin of Launcher
(runtime/launcher.py), whose engines, handshake, API servers and loads it drives."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import msgspec
import zmq

from parashift.engine.placement import node_mesh
from parashift.runtime.autoscaler import Autoscaler
from parashift.runtime.node import ServeArgs
from parashift.runtime.restart_policy import EngineDeath
from parashift.runtime.scale import Phase, ScaleLimits, Scaler
from parashift.types.outputs import SchedulerStats
from parashift.wire import protocol as p

logger = logging.getLogger(__name__)

AUTOSCALER = -1  # the asker of the autoscaler's scales (not an API server: nobody to answer)


class ElasticLaunch:
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
        minimum, minimum_why = self._smallest_size()
        if args.autoscale and args.autoscale.min_size < minimum:
            raise ValueError(f"--data-parallel-size-min {args.autoscale.min_size}: "
                             f"{minimum_why}")
        if self.capacity > self.num_engines:  # engines up to the capacity are valid ranks
            self.config = dataclasses.replace(self.config, parallel=dataclasses.replace(
                self.config.parallel, strategy=self.spec.with_size("dp", self.capacity)))
        self.scaler = Scaler(ScaleLimits(self.capacity, args.startup_timeout,
                                         args.drain_timeout, refusal, minimum, minimum_why),
                             self.num_engines, lambda n: self.engines.room(n))
        self.loads: dict[int, tuple[float, p.EngineLoad]] = {}  # the coordinator's, heard
        self.pending_scales: collections.deque[tuple[int, p.ScaleRequest]] = collections.deque()

    def _scale_refusal(self) -> str:
        """Why this launch cannot change its size ("" when it can)."""
        if self.processes.lockstep:
            return (f"--strategy {self.spec}: expert-parallel lockstep groups do not scale "
                    "(elastic expert parallel, with expert re-sharding, is later work)")
        return ""

    def _smallest_size(self) -> tuple[int, str]:
        """The fewest ranks this launch keeps, and why. Pools scale their decode pool alone:
        the ranks come and go at the top, and the prefill pool stays."""
        prefill = self.processes.prefill_engines
        if prefill:
            return prefill + 1, (f"--strategy {self.spec} keeps its {prefill} prefill rank(s) "
                                 f"and at least one decode rank: {prefill + 1} or more")
        return ScaleLimits.minimum, ScaleLimits.minimum_why

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
            # this node's from their handshake on (their EngineInit names this node's tier)
            self.local_ranks = sorted({*self.local_ranks, *job.ranks})
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


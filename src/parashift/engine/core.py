"""The engine core: a scheduler, an executor and a KV cache; `step` is the whole loop body.

Batches in flight are one mechanism for two purposes, as vLLM's `step_with_batch_queue`: a
step submits new batches until the queue is full or nothing is left to schedule, then waits
for the oldest. A pipeline keeps one batch per stage in flight, each of other requests. Async
scheduling (one stage) keeps two: step N+1 is scheduled and submitted while step N runs, its
requests' tokens from step N as placeholders that the runner fills itself; a structured-output
mask that needs those tokens is made once step N's output is in, while step N+1's forward
runs, and sent after it (vLLM's deferred `sample_tokens`)."""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import os
import time
import uuid

from parashift.config import EngineConfig
from parashift.engine.kv_cache import KVCacheManager
from parashift.engine.kv_tier_connector import MAX_JOBS, TierConnector
from parashift.engine.placement import engine_placement, ray_engine_placement
from parashift.engine.request import Request, check_handed_over, check_prompt_tokens
from parashift.engine.scheduler import Scheduler
from parashift.engine.structured_output import Grammars, GrammarState
from parashift.strategies.disaggregated import engine_pool
from parashift.strategies.mesh import EnginePlacement
from parashift.types.outputs import EngineCoreOutput, SchedulerOutput, SchedulerStats

logger = logging.getLogger(__name__)


def make_executor(config: EngineConfig, placement: EnginePlacement | None = None,
                  lockstep: bool = False):
    """The engine's own process runs the model when the strategy gives it one worker; worker
    processes (or Ray actors) otherwise. `placement`: from the launcher's mesh; by default
    this engine alone on the devices this process sees. `lockstep`: the executors with the
    wave step (executor/lockstep.py)."""
    par = config.parallel
    if placement is None:
        place = (ray_engine_placement if par.distributed_executor_backend == "ray"
                 else engine_placement)
        placement = place(par.strategy, config.device.device, par.data_parallel_rank)
    local, multiproc = _executor_classes(lockstep)
    if len(placement.workers) == 1:
        return local(config, placement)
    from parashift.executor.multiproc import WorkerProcesses

    workers: type = WorkerProcesses
    if par.distributed_executor_backend == "ray":
        from parashift.executor.ray_executor import RayWorkers as workers
    return multiproc(config, placement, logging.getLevelName(
        logging.getLogger().getEffectiveLevel()), workers=workers)


def _executor_classes(lockstep: bool) -> tuple[type, type]:
    """(for one worker, for worker processes); imported only when used."""
    if lockstep:
        from parashift.executor import lockstep as kinds

        return kinds.LockstepLocalExecutor, kinds.LockstepMultiprocExecutor
    from parashift.executor.local import LocalExecutor
    from parashift.executor.multiproc import MultiprocExecutor

    return LocalExecutor, MultiprocExecutor


class EngineCore:
    def __init__(self, config: EngineConfig, executor=None,
                 placement: EnginePlacement | None = None):
        self.config = config
        self.grammars: Grammars | None = None  # structured outputs: made on first use
        self.connector: TierConnector | None = None  # the KV tiers, with --kv-offloading-size
        self.executor = executor or make_executor(config, placement)
        try:
            self._init_kv_cache()
            self.weight_bytes = self.executor.weight_bytes()
        except BaseException:
            self.executor.shutdown()
            raise
        # What start-up built (the model, the block pool: ~300k objects) lives as long as the
        # engine: out of the collector's sight, a full collection takes ms, not 170.
        gc.freeze()

    def _init_kv_cache(self) -> None:
        config = self.config
        num_blocks = self.executor.determine_num_blocks()
        block_size = config.cache.block_size
        capacity = num_blocks * block_size
        max_len = config.model.max_model_len
        if capacity < max_len:
            need = -(-max_len // block_size) * self.executor.kv_block_bytes()
            raise ValueError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len ({max_len}): "
                f"give it at least {need / 2**20:.0f} MiB (--kv-cache-memory / "
                "--gpu-memory-utilization) or lower --max-model-len"
            )
        self.executor.initialize_cache(num_blocks)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%.1f max-length sequences "
                    "at once)", num_blocks, block_size, capacity, capacity / max_len)
        kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.async_scheduling = config.scheduler.async_scheduling  # (resolved: engine/args.py)
        depth = 2 if self.async_scheduling else self.executor.max_batches_in_flight
        if self.async_scheduling:
            logger.info("async scheduling: step N+1 is scheduled while step N runs")
        self.connector = self._kv_tiers(kv_cache)
        par = config.parallel
        limits = config.scheduler.for_pool(engine_pool(par.strategy, par.data_parallel_rank))
        self.scheduler = Scheduler(limits, kv_cache, depth, config.model.vocab_size,
                                   placeholders=self.async_scheduling, connector=self.connector)
        self.batch_queue: collections.deque[SchedulerOutput] | None = (
            collections.deque() if depth > 1 else None)

    def _kv_tiers(self, kv_cache: KVCacheManager) -> TierConnector | None:
        """The host tier (the node's arena: the launcher's, else this engine's own) and the
        disk tier, behind their connector; the workers attach to the arena."""
        cache, model = self.config.cache, self.config.model
        if not cache.kv_offloading_size:
            return None
        from parashift.kv_tiers.disk_tier import DiskTier
        from parashift.kv_tiers.host_arena import HostArena
        from parashift.kv_tiers.identity import tier_identity
        from parashift.kv_tiers.shm_files import shm_path, sweep

        num_workers = self.executor.num_workers
        worker_bytes = self.executor.kv_block_bytes()
        slot_bytes = worker_bytes * num_workers
        # The shard layout, not the DP size: every DP rank of the node shares the tier.
        layout = ",".join(f"{axis}{size}" for axis, size in
                          sorted(self.config.parallel.strategy.sizes().items()) if axis != "dp")
        identity = tier_identity(model.path, str(model.dtype), cache.block_size, layout,
                                 worker_bytes, num_workers)
        if cache.kv_host_tier is None:  # an arena of its own (no launcher's): it sweeps
            sweep()
        path = cache.kv_host_tier or shm_path(f"parashift-kv-{os.getpid()}-{uuid.uuid4().hex}")
        arena = HostArena.open(path, cache.kv_offloading_size, slot_bytes,
                               owner=cache.kv_host_tier is None)
        try:
            disk = (DiskTier(cache.kv_disk_dir, cache.kv_disk_size, identity, slot_bytes,
                             writer=False) if cache.kv_disk_dir else None)
            connector = TierConnector(kv_cache, arena, identity, slot_bytes, num_workers, disk,
                                      cache.kv_disk_dir, cache.kv_disk_size or 0,
                                      store_decode=cache.kv_offloading_decode)
        except BaseException:
            arena.close()
            raise
        self.executor.attach_kv_tiers(arena.path, slot_bytes, connector.board.path, MAX_JOBS,
                                      num_workers, worker_bytes)
        logger.info("KV host tier: %d blocks of %d bytes in %s%s", arena.num_slots, slot_bytes,
                    arena.path, f"; disk tier in {cache.kv_disk_dir}" if disk else "")
        return connector

    def add_request(self, request: Request) -> None:
        """Raises ValueError for a request the model cannot run: it fails alone, the engine
        stays up."""
        model = self.config.model
        check_prompt_tokens(request.prompt_token_ids, model.vocab_size)
        check_handed_over(request, model.vocab_size, model.max_model_len)
        if request.hands_off and self.connector is None:
            raise ValueError("this engine has no KV tier to hand a prompt's KV over through "
                             "(--kv-offloading-size)")
        constraint = request.params.structured_outputs
        if constraint is not None:  # compiled off the loop; the request waits for it
            request.grammar = GrammarState(self.structured_grammars().compile(constraint),
                                           request.eos_token_id)
        self.scheduler.add_request(request)

    def structured_grammars(self) -> Grammars:
        if self.grammars is None:
            model = self.config.model
            rank = self.config.parallel.data_parallel_rank
            self.grammars = Grammars(model.tokenizer_path, model.vocab_size,
                                     name=f"parashift-grammar-dp{rank}")
        return self.grammars

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests or bool(self.batch_queue)

    def has_work(self) -> bool:
        """Requests, or KV copies to see to the end (a request's last step may start a store
        that only a later step settles)."""
        return self.has_unfinished_requests() or (self.connector is not None
                                                  and self.connector.busy)

    def step(self) -> list[EngineCoreOutput]:
        if self.batch_queue is not None:
            return self._step_with_batch_queue()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not (scheduler_output.freed_req_ids
                                              or scheduler_output.kv_jobs):
            return self._idle_step()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        queue = self.batch_queue
        while len(queue) < self.scheduler.max_batches_in_flight:
            scheduler_output = self.scheduler.schedule()
            empty = scheduler_output.is_empty  # everything left is in flight already
            # (workers must drop the freed requests and start the KV transfers)
            if not empty or scheduler_output.freed_req_ids or scheduler_output.kv_jobs:
                self.executor.submit(scheduler_output)
                queue.append(scheduler_output)
            if empty:
                break
        if not queue:
            return self._idle_step()
        # The result first: if waiting fails, the batch stays queued to meet its result later.
        runner_output = self.executor.wait()
        outputs = self.scheduler.update_from_output(queue.popleft(), runner_output)
        if queue and queue[0].grammar_deferred:  # its forward runs; its mask is known now
            self.executor.sample_tokens(self.scheduler.deferred_bitmask(queue[0]))
        return outputs

    def _idle_step(self) -> list[EngineCoreOutput]:
        """Nothing to run: what finished unscheduled; with only compiling requests left, a
        wait for a compile (not a spin)."""
        if self.connector is not None and self.connector.busy:
            # Copies in flight report on the job board, which has no wake-up; a worker that
            # died would never report: its death ends the engine instead.
            self.executor.check_health()
            time.sleep(0.001)
        elif self.grammars is not None:
            self.grammars.wait_for_any(0.05)
        return self.scheduler.take_unscheduled_outputs()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache.pool.reset_prefix_cache()

    def sleep(self, level: int) -> int:
        """Level 1 frees the KV cache, level 2 the weights too; only with no request left (the
        engine process drains first). Returns the bytes the workers released."""
        self._drain_kv_transfers()
        # The blocks' contents are about to go: no hash may outlive them. Drained, every
        # block is free, so the reset cannot be refused.
        assert self.reset_prefix_cache(), "sleep with KV blocks in use"
        return sum(self.executor.sleep(level))

    def _drain_kv_transfers(self, timeout: float | None = None) -> None:
        """Stores still copying hold their blocks: they end before the cache goes."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.connector is not None and self.connector.busy:
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("KV copies still in flight at shutdown: not kept")
                return
            self.step()  # no request is left: a step only settles and starts transfers

    def wake_up(self) -> None:
        self.executor.wake_up()

    def shutdown(self) -> None:
        if self.connector is not None:
            with contextlib.suppress(Exception):  # (a worker gone: what is copied is kept)
                self._drain_kv_transfers(timeout=10.0)
            self.connector.close()
        if self.grammars is not None:
            self.grammars.shutdown()
        self.executor.shutdown()

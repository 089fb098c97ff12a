"""The executor for an engine whose one worker is the engine process itself.

With async scheduling the worker lives in a thread of its own ("parashift-runner"), so that
the engine schedules step N+1 and processes step N's outputs while step N runs: `submit`
queues a step, `wait` returns the oldest step's output, `sample_tokens` hands a deferred step
its mask. Torch releases the GIL inside its ops (and ctypes inside our compiled kernels).
Everything the worker does runs in that thread, its loading too: OpenMP keeps a team of
threads per calling thread, and with a second team alive libgomp sees more threads than cores
and stops spin-waiting between parallel regions (measured: a decode step 35% slower)."""

from __future__ import annotations

import collections
import queue
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from parashift.config import EngineConfig
from parashift.distributed.expert_group import cross_engine_groups
from parashift.distributed.parallel_context import ParallelContext
from parashift.executor.step_result import DEFERRED, Sampled, StepResult
from parashift.executor.worker import Worker, threads_for, worker_class
from parashift.strategies.layout import MeshPoint
from parashift.strategies.mesh import EnginePlacement
from parashift.types.outputs import GrammarBitmask, ModelRunnerOutput, SchedulerOutput


class LocalExecutor:
    max_batches_in_flight = 1  # one step at a time: the model runs in this process
    num_workers = 1
    worker_base: type[Worker] = Worker

    def __init__(self, config: EngineConfig, placement: EnginePlacement):
        (rank,) = placement.workers
        if rank.cuda_index is not None:
            torch.cuda.set_device(rank.cuda_index)
        spec = config.parallel.strategy
        shard = spec.shard(MeshPoint(rank.coords, spec.sizes()), config.model.hf_config)
        groups = cross_engine_groups(spec, config.parallel.expert_group_address,
                                     config.parallel.expert_group_key, rank.coords,
                                     rank.cuda_index is not None)
        self._thread = (ThreadPoolExecutor(1, thread_name_prefix="parashift-runner")
                        if config.scheduler.async_scheduling else None)
        self._futures: collections.deque[Future] = collections.deque()
        self._masks: queue.SimpleQueue[GrammarBitmask | None] = queue.SimpleQueue()
        try:
            if rank.cuda_index is not None and self._thread is not None:
                self._call(torch.cuda.set_device, rank.cuda_index)  # per thread
            self.worker = self._call(worker_class(config, self.worker_base), config,
                                     ParallelContext(shard, groups),
                                     threads_for(config, rank.cpu_ids))
        except BaseException:
            self.shutdown()
            raise

    def _call(self, fn, *args):
        """`fn(*args)` where the worker lives."""
        return fn(*args) if self._thread is None else self._thread.submit(fn, *args).result()

    def determine_num_blocks(self) -> int:
        return self._call(self.worker.determine_num_blocks)

    def weight_bytes(self) -> list[int]:
        return [self._call(self.worker.weight_bytes)]

    def kv_block_bytes(self) -> int:
        return self._call(self.worker.kv_block_bytes)

    def initialize_cache(self, num_blocks: int) -> None:
        self._call(self.worker.initialize_cache, num_blocks)

    def attach_kv_tiers(self, *link) -> None:
        self._call(self.worker.attach_kv_tiers, *link)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        result = self._call(self.worker.execute_model, scheduler_output)
        assert isinstance(result, Sampled), "a deferred mask needs submit / sample_tokens / wait"
        return result.host_output()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        assert self._thread is not None, "submit is for async scheduling"
        self._futures.append(self._thread.submit(self._execute, scheduler_output))

    def _execute(self, scheduler_output: SchedulerOutput) -> StepResult:
        result = self.worker.execute_model(scheduler_output)
        if result is DEFERRED:  # its mask comes once the steps before it have returned
            result = self.worker.sample_tokens(self._masks.get())
        return result

    def sample_tokens(self, grammar: GrammarBitmask | None) -> None:
        self._masks.put(grammar)

    def wait(self) -> ModelRunnerOutput:
        """The ids come to the host here, in the engine's thread: the runner goes on."""
        result = self._futures.popleft().result()
        assert isinstance(result, Sampled)  # the engine's own worker is the output rank
        return result.host_output()

    def sleep(self, level: int) -> list[int]:
        return [self._call(self.worker.sleep, level)]

    def wake_up(self) -> None:
        self._call(self.worker.wake_up)

    def check_health(self) -> None:
        pass  # the worker is this process

    def shutdown(self) -> None:
        if self._thread is not None:
            self._masks.put(None)  # a step still waiting for its mask ends
            self._thread.shutdown(wait=True, cancel_futures=True)

"""The executor for an engine whose one worker is the engine process itself."""

from __future__ import annotations

import torch

from parashift.config import EngineConfig
from parashift.distributed.expert_group import cross_engine_groups
from parashift.distributed.parallel_context import ParallelContext
from parashift.executor.worker import threads_for, worker_class
from parashift.strategies.layout import MeshPoint
from parashift.strategies.mesh import EnginePlacement
from parashift.types.outputs import ModelRunnerOutput, SchedulerOutput, WaveStepOutput


class LocalExecutor:
    max_batches_in_flight = 1  # one step at a time: the model runs in this process

    def __init__(self, config: EngineConfig, placement: EnginePlacement):
        (rank,) = placement.workers
        if rank.cuda_index is not None:
            torch.cuda.set_device(rank.cuda_index)
        spec = config.parallel.strategy
        shard = spec.shard(MeshPoint(rank.coords, spec.sizes()), config.model.hf_config)
        groups = cross_engine_groups(spec, config.parallel.expert_group_address, rank.coords,
                                     rank.cuda_index is not None)
        self.worker = worker_class(config)(config, ParallelContext(shard, groups),
                                           threads_for(config, rank.cpu_ids))

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def weight_bytes(self) -> list[int]:
        return [self.worker.weight_bytes()]

    def kv_block_bytes(self) -> int:
        return self.worker.kv_block_bytes()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_wave_step(self, scheduler_output: SchedulerOutput, has_work: bool
                          ) -> WaveStepOutput:
        return self.worker.execute_wave_step(scheduler_output, has_work)

    def sleep(self, level: int) -> list[int]:
        return [self.worker.sleep(level)]

    def wake_up(self) -> None:
        self.worker.wake_up()

    def check_health(self) -> None:
        pass  # the worker is this process

    def shutdown(self) -> None:
        pass

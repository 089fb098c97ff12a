"""The executor for one worker in the engine's own process (tp1, pp1)."""

from __future__ import annotations

from parashift.config import EngineConfig
from parashift.executor.worker import Worker
from parashift.types.outputs import ModelRunnerOutput, SchedulerOutput


class LocalExecutor:
    def __init__(self, config: EngineConfig):
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def kv_block_bytes(self) -> int:
        return self.worker.kv_block_bytes()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def check_health(self) -> None:
        pass  # the worker is this process

    def shutdown(self) -> None:
        pass

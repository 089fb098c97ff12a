"""The user-facing engine knobs (CLI flags and `LLM(...)` keywords) and how they become the
validated configs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parashift.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_dtype,
)
from parashift.defaults import default_max_num_batched_tokens
from parashift.models.loader import load_hf_config, resolve_model_path
from parashift.models.registry import architecture_of, get_model_class
from parashift.strategies.spec import StrategySpec


@dataclass
class EngineArgs:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str | None = None
    num_threads: int | None = None
    strategy: str | None = None  # e.g. "dp2"; the explicit sizes below must agree with it
    data_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    enable_expert_parallel: bool = False
    data_parallel_rank: int = 0
    distributed_executor_backend: str = "mp"  # "ray" inside engines run as Ray actors

    def strategy_spec(self) -> StrategySpec:
        """`--strategy` and vLLM's explicit flags are interchangeable; a conflict is an error
        naming both."""
        explicit = {"dp": ("--data-parallel-size", self.data_parallel_size),
                    "tp": ("--tensor-parallel-size", self.tensor_parallel_size),
                    "pp": ("--pipeline-parallel-size", self.pipeline_parallel_size)}
        ep = self.enable_expert_parallel
        if self.strategy is None:
            return StrategySpec.from_sizes(*(v or 1 for _, v in explicit.values()),
                                           ep=bool(ep))
        spec = StrategySpec.parse(self.strategy)
        for name, (flag, value) in explicit.items():
            if value is not None and value != spec.size(name):
                raise ValueError(f"--strategy {spec} sets {name}={spec.size(name)} but {flag} "
                                 f"is {value}")
        if ep and not spec.size("ep"):
            raise ValueError(f"--strategy {spec} has no ep axis but --enable-expert-parallel "
                             "is given")
        return spec

    def create_config(self) -> EngineConfig:
        spec = self.strategy_spec()
        parallel = ParallelConfig(spec.size("dp"), spec.size("tp"), spec.size("pp"),
                                  bool(spec.size("ep")), self.data_parallel_rank,
                                  self.distributed_executor_backend)
        path = resolve_model_path(self.model)
        hf_config = load_hf_config(path)
        get_model_class(architecture_of(hf_config))
        spec.validate(hf_config)
        device = DeviceConfig(self.device) if self.device else DeviceConfig()
        if self.num_threads is not None:
            device = DeviceConfig(device.device, self.num_threads)
        checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(
            hf_config, "torch_dtype", None)
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
        dtype = resolve_dtype(self.dtype, checkpoint_dtype, device.device)
        max_model_len = self.max_model_len or getattr(hf_config, "max_position_embeddings", 2048)
        model = ModelConfig(path, hf_config, dtype, max_model_len, self.tokenizer or path,
                            self.seed)
        budget = self.max_num_batched_tokens or default_max_num_batched_tokens(self.max_num_seqs)
        scheduler = SchedulerConfig(budget, self.max_num_seqs, max_model_len,
                                    self.enable_chunked_prefill)
        cache = CacheConfig(self.block_size, self.kv_cache_memory, self.gpu_memory_utilization,
                            self.enable_prefix_caching, self.num_gpu_blocks_override)
        return EngineConfig(model, cache, scheduler, parallel, device)

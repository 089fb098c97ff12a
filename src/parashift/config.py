"""Engine configuration: one frozen dataclass per concern, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype | None, device: str) -> torch.dtype:
    """`auto` keeps the checkpoint's half precision on GPU; on CPU it uses bfloat16 for half
    checkpoints (float16 matmuls are slow on CPUs) and float32 otherwise."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
        return _DTYPES[dtype]
    if checkpoint_dtype in (torch.float16, torch.bfloat16):
        return checkpoint_dtype if device != "cpu" else torch.bfloat16
    return torch.float32


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how. `hf_config` is the transformers config of the checkpoint."""

    path: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    tokenizer_path: str
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if limit is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({limit}); pass --max-model-len {limit} or less"
            )

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. On CPU the budget is `kv_cache_memory` bytes; on GPU it is the share
    `gpu_memory_utilization` of device memory left after a profiling pass."""

    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be >= 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill --max-num-batched-tokens ({self.max_num_batched_tokens})"
                f" must be >= --max-model-len ({self.max_model_len})"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Sizes of each parallel axis, from the strategy (strategies/spec.py). Data parallel runs
    one engine process per rank (`parashift run`); the other axes arrive with their issues and
    are refused by their strategy classes until then."""

    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_rank: int = 0
    distributed_executor_backend: str = "mp"  # "ray": tp workers are Ray actors

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
            size = getattr(self, name)
            if size < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {size}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data parallel rank {self.data_parallel_rank} is outside "
                             f"0..{self.data_parallel_size - 1}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class DeviceConfig:
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    num_threads: int | None = None  # CPU only; None = torch's default

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig


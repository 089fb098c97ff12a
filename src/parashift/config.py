"""Engine configuration: one frozen dataclass per concern, validated on construction."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from parashift.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    resolve_dtype_name,
)

if TYPE_CHECKING:  # torch is imported where it is used: `plan` replays the scheduler without it
    import torch

    from parashift.strategies.spec import StrategySpec


def resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype | None, device: str) -> torch.dtype:
    """The engine's dtype (the rule, torch-free for `plan`, is defaults.resolve_dtype_name)."""
    import torch

    checkpoint = str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype else None
    return getattr(torch, resolve_dtype_name(dtype, checkpoint, device))


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how. `hf_config` is the transformers config of the checkpoint."""

    path: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    tokenizer_path: str
    seed: int = 0
    quantization: str | None = None  # layers/quantization.py
    source: str | None = None  # the model as the user named it (None: the embedded SmolLM2)

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

    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # KV tiers (kv_tiers/): the node's host arena of this many bytes, and a disk folder
    kv_offloading_size: int | None = None
    kv_disk_dir: str | None = None
    kv_disk_size: int | None = None
    kv_host_tier: str | None = None  # the arena's file, made by the launcher for its engines
    kv_offloading_decode: bool = False  # the tier also takes blocks filled by output tokens

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
        if self.kv_offloading_size is not None and self.kv_offloading_size <= 0:
            raise ValueError(f"--kv-offloading-size must be positive, got "
                             f"{self.kv_offloading_size}")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size needs prefix caching (its blocks are found "
                             "by their prefix hashes): drop --no-enable-prefix-caching")
        if (self.kv_disk_dir is None) != (self.kv_disk_size is None):
            raise ValueError("--kv-disk-dir and --kv-disk-size go together")
        if self.kv_disk_dir is not None and not self.kv_offloading_size:
            raise ValueError("--kv-disk-dir needs --kv-offloading-size (disk blocks are read "
                             "through the host tier)")
        if self.kv_offloading_decode and not self.kv_offloading_size:
            raise ValueError("--kv-offloading-decode needs --kv-offloading-size")
        if self.kv_disk_size is not None and self.kv_disk_size <= 0:
            raise ValueError(f"--kv-disk-size must be positive, got {self.kv_disk_size}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    max_waiting_requests: int | None = None
    while_asleep: str = "reject"  # a request to a sleeping engine: "reject" (503) or "wait"
    # schedule step N+1 while step N runs (engine/core.py); resolved from --async-scheduling
    async_scheduling: bool = False
    # Prefill/decode pools: a pool's own limits where given (None: the ones above).
    prefill_max_num_batched_tokens: int | None = None
    prefill_max_num_seqs: int | None = None
    decode_max_num_batched_tokens: int | None = None
    decode_max_num_seqs: int | None = None
    # Lockstep groups: new prefill work only on steps of a wave that are multiples of this
    # (engine/prefill_cadence.py); 1: every step.
    prefill_schedule_interval: int = 1

    def __post_init__(self) -> None:
        if self.while_asleep not in ("reject", "wait"):
            raise ValueError(f"--while-asleep {self.while_asleep!r}: use reject or wait")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(
                f"--max-waiting-requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        for pool in ("prefill", "decode"):
            for limit in ("max_num_batched_tokens", "max_num_seqs"):
                value = getattr(self, f"{pool}_{limit}")
                if value is not None and value < 1:
                    raise ValueError(f"--{pool}-{limit.replace('_', '-')} must be >= 1, "
                                     f"got {value}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill --max-num-batched-tokens ({self.max_num_batched_tokens})"
                f" must be >= --max-model-len ({self.max_model_len})"
            )

    def for_pool(self, pool: str | None) -> SchedulerConfig:
        """The limits of an engine of `pool` ("prefill", "decode"; None: no pools)."""
        if pool is None:
            return self
        tokens = getattr(self, f"{pool}_max_num_batched_tokens") or self.max_num_batched_tokens
        seqs = getattr(self, f"{pool}_max_num_seqs") or self.max_num_seqs
        return dataclasses.replace(self, max_num_batched_tokens=tokens, max_num_seqs=seqs)


@dataclass(frozen=True)
class ParallelConfig:
    """The parsed strategy (its axis objects, plugins included: the layout is theirs to
    decide) and which data-parallel rank this engine is."""

    strategy: StrategySpec
    data_parallel_rank: int = 0
    distributed_executor_backend: str = "mp"  # "ray": workers are Ray actors
    # Expert parallel over several engines: where this incarnation of the group's store is
    # (ipc:// on one node, tcp:// over nodes; from the launcher's handshake).
    expert_group_address: str | None = None
    shm_all_reduce: bool = True  # CPU tp workers of one node sum through shared memory
    # This rank's key on the cluster's links (set by the engine from its handshake, never
    # sent in a config): the group's store over CURVE answers only ranks' keys.
    expert_group_key: tuple[bytes, bytes] | None = field(default=None, repr=False,
                                                         compare=False)

    def __post_init__(self) -> None:
        num_engines = self.strategy.processes().num_engines
        if not 0 <= self.data_parallel_rank < num_engines:
            raise ValueError(f"data parallel rank {self.data_parallel_rank} is outside "
                             f"0..{num_engines - 1}")


GEMM_PATHS = ("linear", "onednn", "own-bf16")  # layers/gemm.py's classes, by name


def check_cpu_kernels(value: str) -> None:
    """--cpu-kernels: native, off, or a gcc -march name (it reaches g++'s command line)."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.+-]{0,39}", value):
        raise ValueError(f"--cpu-kernels {value!r}: use native, off, or a gcc -march name "
                         "such as haswell")


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class DeviceConfig:
    device: str = field(default_factory=_default_device)
    num_threads: int | None = None  # CPU only; None = torch's default
    attention_backend: str = "torch"  # resolved: never "auto"
    enforce_eager: bool = False  # CUDA only: decode without CUDA graphs
    cpu_kernels: str = "native"  # "native", "off" or a gcc -march (EngineArgs.cpu_kernels)
    # CPU: the GEMM paths the load-time timing chooses among (layers/gemm_paths.py); each
    # keeps one copy of a weight in the model's dtype, so the choice never changes the bytes
    gemm_paths: tuple[str, ...] = GEMM_PATHS
    # batch-invariant numerics (EngineArgs.deterministic): gemm_paths then goes unused
    deterministic: bool = False

    def __post_init__(self) -> None:
        check_cpu_kernels(self.cpu_kernels)
        unknown = [p for p in self.gemm_paths if p not in GEMM_PATHS]
        if unknown or "linear" not in self.gemm_paths:
            raise ValueError(f"--gemm-paths {','.join(self.gemm_paths)}: choose among "
                             f"{', '.join(GEMM_PATHS)}, linear included (every weight can "
                             "take it)")

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    worker_extension_cls: str | None = None

    def for_engine(self, rank: int, backend: str, expert_group_address: str | None
                   ) -> EngineConfig:
        """This launch's config as engine `rank` runs it: its rank, the executor backend and
        where this incarnation of its expert group meets (the launcher's to say)."""
        return dataclasses.replace(self, parallel=dataclasses.replace(
            self.parallel, data_parallel_rank=rank, distributed_executor_backend=backend,
            expert_group_address=expert_group_address))


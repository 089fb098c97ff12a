"""A worker owns one device: the model (or its shard), its slice of the KV cache, the runner."""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib
import logging

import torch
import torch.distributed as dist

from parashift.config import EngineConfig
from parashift.defaults import DEFAULT_CPU_KV_CACHE_MEMORY
from parashift.distributed.parallel_context import ParallelContext
from parashift.executor.layer_paths import FUSED, choose_layer_path
from parashift.executor.model_runner import ModelRunner
from parashift.executor.step_result import StepResult
from parashift.kv_tiers.transfers import KVTransfers, TierLink
from parashift.layers.attention.backend import get_attention_backend
from parashift.layers.gemm_paths import GemmPaths, prepare_gemm_weights, weight_bytes
from parashift.layers.kernel_dispatch import use_cpu_kernels
from parashift.models.loader import load_model
from parashift.processes import status_bytes
from parashift.types.outputs import GrammarBitmask, SchedulerOutput

logger = logging.getLogger(__name__)


def threads_for(config: EngineConfig, cpu_ids: tuple[int, ...]) -> int | None:
    """A CPU worker's threads: --threads, else one per core the mesh pinned it to (None:
    torch's default)."""
    return config.device.num_threads or len(cpu_ids) or None


def worker_class(config: EngineConfig, base: type[Worker] | None = None) -> type[Worker]:
    """`base` (Worker by default), or `base` with `config.worker_extension_cls` (module.Class)
    mixed in."""
    base = base or Worker
    if config.worker_extension_cls is None:
        return base
    module, _, name = config.worker_extension_cls.rpartition(".")
    try:
        extension = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"worker_extension_cls {config.worker_extension_cls!r}: {e}"
                         ) from None
    return type(f"{name}Worker", (extension, base), {})


class Worker:
    """`parallel`: this rank's shard plan and process groups (a size-1 context: the whole
    model, no collectives)."""

    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None,
                 num_threads: int | None = None):
        self.config = config
        self.parallel = parallel or ParallelContext()
        self.device = config.device.torch_device
        num_threads = num_threads or config.device.num_threads
        if self.device.type == "cpu" and num_threads:
            torch.set_num_threads(num_threads)
        use_cpu_kernels(config.device.cpu_kernels)
        torch.manual_seed(config.model.seed)
        self.backend = get_attention_backend(config.device.attention_backend,
                                             config.device.deterministic)
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.tier_link: TierLink | None = None  # the KV tiers' arena and job board, if any
        self.kv_transfers: KVTransfers | None = None
        self.sleep_level = 0  # 1: the KV cache is freed; 2: the weights too
        self._load_model()

    def _load_model(self) -> None:
        mc = self.config.model
        self.model = load_model(mc.path, mc.hf_config, mc.dtype, self.device, self.backend,
                                mc.max_model_len, self.parallel)
        device = self.config.device
        paths = GemmPaths() if self.device.type == "cpu" else None
        own_layers = (paths is not None and not mc.quantization and not device.deterministic
                      and choose_layer_path(self.model, self.backend,
                                            self.config.cache.block_size, paths,
                                            device.gemm_paths) == FUSED)
        for note in prepare_gemm_weights(self.model, self.device,  # after: it may time GEMMs
                                         mc.quantization, device.gemm_paths,
                                         device.deterministic, paths, own_layers):
            logger.info(note)
        tp = self.parallel.group("tp")
        # Async scheduling's placeholders: tp rank 0 shares what it sampled.
        shares = self.config.scheduler.async_scheduling and tp.world_size > 1
        self.runner = ModelRunner(self.model, self.backend, self.config.cache.block_size,
                                  self.device, mc.max_model_len, self.parallel.group("pp"),
                                  tp if shares else None,
                                  placeholders=self.config.scheduler.async_scheduling,
                                  output_rank=self.is_output_rank)

    def sleep(self, level: int) -> int:
        """Free the KV cache (level 1) and the weights too (level 2); the engine has no request
        left. Returns the bytes released (resident memory on CPU, device memory on GPU)."""
        before = self.memory_bytes()
        self._close_transfers()  # (the engine ended its transfers before it slept)
        self._allocate_cache(0)
        self.runner.graphs = None  # captured on the freed cache
        if level >= 2:  # every reference to the weights
            self.model = self.runner = None  # type: ignore[assignment]
        gc.unfreeze()  # the model's reference cycles were frozen at start-up: collect them
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _trim_heap()
        self.sleep_level = max(self.sleep_level, level)
        return before - self.memory_bytes()

    def wake_up(self) -> None:
        """Reload the weights (from the converted checkpoint) if they were freed, and give
        back the KV cache, empty."""
        if self.sleep_level >= 2:
            self._load_model()
        self.sleep_level = 0
        self.initialize_cache(self.num_blocks)

    def memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return status_bytes("VmRSS")

    @property
    def is_output_rank(self) -> bool:
        """The worker that answers each step with the sampled tokens: the last pipeline
        stage's tp rank 0."""
        shard = self.parallel.shard
        return shard.has_lm_head and shard.tp_rank == 0

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (layers/gemm_paths.py): what `plan` predicts."""
        return weight_bytes(self.model)

    def stop(self) -> None:
        """Before the process exits: the last activations sent must reach the next stage."""
        if self.runner is not None:  # None: asleep at level 2, nothing in flight
            self.runner.pp.wait_sends()
        self._close_transfers()

    def kv_block_bytes(self) -> int:
        """Bytes of one block over this worker's layers (its pipeline stage's), K and V."""
        layer = self.model.attention_layers[0]
        per_layer = 2 * self.config.cache.block_size * layer.num_kv_heads * layer.head_dim
        itemsize = torch.empty((), dtype=self.config.model.dtype).element_size()
        return per_layer * itemsize * len(self.model.attention_layers)

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cpu":
            budget = cache.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        else:
            budget = self._profile_free_gpu_memory()
        return max(0, budget // self.kv_block_bytes())

    def _profile_free_gpu_memory(self) -> int:
        """Run the largest step once without a real cache; what is left of the utilisation
        target after the peak goes to the KV cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = min(self.config.scheduler.max_num_batched_tokens, self.config.model.max_model_len)
        self._allocate_cache(-(-tokens // self.config.cache.block_size))
        self.runner.profile_run(tokens)
        self._allocate_cache(0)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        _, total = torch.cuda.mem_get_info(self.device)
        torch.cuda.empty_cache()
        return int(total * self.config.cache.gpu_memory_utilization) - peak

    def initialize_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._allocate_cache(num_blocks)
        if num_blocks and self.uses_cuda_graphs:
            self.runner.capture_decode_graphs(self.config.scheduler.max_num_seqs,
                                              self.config.model.max_model_len)
        gc.freeze()  # the model and its cache stay (until a sleep): no collection rescans them

    def _allocate_cache(self, num_blocks: int) -> None:
        layers = self.model.attention_layers
        shape = (num_blocks, self.config.cache.block_size, layers[0].num_kv_heads,
                 layers[0].head_dim)
        dtype = self.config.model.dtype
        # Zeroed, not empty: masked-out padding positions must never hold NaNs. Not in huge
        # pages on CPU (as the packed weights are): on VMs that back guest memory on first
        # touch, fresh 2 MiB pages fault in slowly enough to add seconds to start-up, and the
        # decode ran no faster from them.
        zeros = functools.partial(torch.zeros, shape, dtype=dtype, device=self.device)
        self.kv_caches = [(zeros(), zeros()) for _ in layers]
        self.runner.bind_kv_cache(self.kv_caches)
        if num_blocks and self.tier_link is not None:  # woken up: the new cache's transfers
            self.kv_transfers = KVTransfers(self.tier_link, self._tier_index(), self.kv_caches)

    @property
    def uses_cuda_graphs(self) -> bool:
        """Decode from CUDA graphs: on CUDA with the Triton backend, unless --enforce-eager;
        for now a whole model on one device (tp1, pp1, no expert parallel over engines)."""
        shard, device = self.parallel.shard, self.config.device
        return (self.device.type == "cuda" and device.attention_backend == "triton"
                and not device.enforce_eager and shard.tp_size == 1
                and self.runner.pp.world_size == 1 and self.runner.dispatcher is None)

    def attach_kv_tiers(self, arena_path: str, slot_bytes: int, board_path: str,
                        num_jobs: int, num_workers: int, worker_bytes: int) -> None:
        """The engine's KV tiers: copies between this worker's cache and the node's arena."""
        self.tier_link = TierLink(arena_path, slot_bytes, board_path, num_jobs, num_workers,
                                  worker_bytes)
        self.kv_transfers = KVTransfers(self.tier_link, self._tier_index(), self.kv_caches)

    @staticmethod
    def _tier_index() -> int:
        """Its share's place in an arena slot: its rank among the engine's workers."""
        return dist.get_rank() if dist.is_initialized() else 0

    def _close_transfers(self) -> None:
        if self.kv_transfers is not None:
            self.kv_transfers.close()
            self.kv_transfers = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> StepResult:
        transfers, jobs = self.kv_transfers, scheduler_output.kv_jobs
        if transfers is None or not jobs:
            return self.runner.execute_model(scheduler_output)
        transfers.before_forward(jobs)
        result = self.runner.execute_model(scheduler_output)
        transfers.after_forward(jobs)
        return result

    def sample_tokens(self, grammar: GrammarBitmask | None) -> StepResult:
        return self.runner.sample_tokens(grammar)


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc keeps tensors below its growing mmap
    threshold on the heap, where freeing them does not lower the RSS)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass

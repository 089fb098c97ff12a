"""What a plan is computed for (PlanSettings), from the engine's own flags and configs. `plan`
builds it from EngineArgs and the hardware it is told of, checked by the config's dataclasses
(a dry run: nothing is loaded, torch neither); `--strategy auto` from the config the launch
resolved (create_config), on this machine."""

from __future__ import annotations

import os
from dataclasses import dataclass

from parashift.cli_options import parse_size
from parashift.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from parashift.defaults import DTYPE_BYTES, default_max_num_batched_tokens, resolve_dtype_name
from parashift.engine.args import EngineArgs, gemm_paths, host_tier_size, strategy_spec
from parashift.plan.estimate import PlanSettings, keeps_shared_weight_copies
from parashift.plan.hardware import DEVICES, INTER_NODE, INTRA_NODE, Device, Link
from parashift.plan.shape import ModelShape
from parashift.strategies.spec import StrategySpec

FP8_BYTES = 1  # `plan --dtype fp8`: a what-if, no engine runs it


@dataclass(frozen=True)
class Hardware:
    """The machines a plan is for: a device profile (hardware.py), its memory (or another),
    the nodes they sit in, and the links within a node and across nodes."""

    device: Device
    nodes: int = 1
    intra: Link | None = None
    inter: Link = INTER_NODE["ib"]
    device_memory: int | None = None  # overrides the profile's

    @classmethod
    def from_flags(cls, device: str, nodes: int, intra_node: str | None, inter_node: str,
                   device_memory: str | None) -> Hardware:
        if device not in DEVICES:
            raise ValueError(f"--device {device!r}: known devices are {', '.join(DEVICES)}")
        if intra_node is not None and intra_node not in INTRA_NODE:
            raise ValueError(f"--intra-node {intra_node!r}: use {' | '.join(INTRA_NODE)}")
        if inter_node not in INTER_NODE:
            raise ValueError(f"--inter-node {inter_node!r}: use {' | '.join(INTER_NODE)}")
        if nodes < 1:
            raise ValueError("--nodes must be >= 1")
        memory = parse_size(device_memory, "--device-memory") if device_memory else None
        return cls(DEVICES[device], nodes, INTRA_NODE.get(intra_node or ""),
                   INTER_NODE[inter_node], memory)

    @property
    def kind(self) -> str:
        """The engine's device kind, whose rules (dtype, step budget) the plan follows."""
        return "cuda" if self.device.is_gpu else "cpu"


@dataclass(frozen=True)
class Workload:
    """The requests the pipeline bubble is estimated for."""

    concurrency: tuple[int, ...] = (1, 4, 32)
    prompt_len: int = 512
    output_len: int = 1  # 1: prefill only

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError("--prompt-len must be >= 1")
        if self.output_len < 1:
            raise ValueError("--output-len must be >= 1")


def layout(args: EngineArgs, devices: int | None, nodes: int = 1) -> tuple[StrategySpec, int]:
    """The strategy, read from --strategy and vLLM's size flags as `run` reads them (none of
    them: dp over all the devices), and the devices in all (--devices, else the strategy's)."""
    sizes = (args.data_parallel_size, args.tensor_parallel_size, args.pipeline_parallel_size)
    given = (args.strategy is not None or args.pp_layer_partition is not None
             or args.enable_expert_parallel or any(size is not None for size in sizes))
    spec = strategy_spec(args) if given else None
    n = devices if devices is not None else (spec.world_size if spec else 1)
    if n < 1:
        raise ValueError(f"--devices {n}: need at least one device")
    if nodes > n:
        raise ValueError(f"--nodes {nodes} is more than --devices {n}")
    return spec or StrategySpec.from_sizes(dp=n), n


def dry_run_settings(args: EngineArgs, shape: ModelShape, hardware: Hardware, devices: int,
                     workload: Workload = Workload()) -> PlanSettings:
    """The settings of `plan`: the engine's flags as create_config would resolve them for a
    device of this kind, checked by the same config classes, without the model's files."""
    is_gpu = hardware.device.is_gpu
    if args.quantization is not None and is_gpu:
        raise ValueError(f"--quantization {args.quantization} runs on --device cpu, not on "
                         f"{hardware.device.name}")
    # The engine's dtype rule and table (defaults.py), on the checkpoint's dtype.
    dtype = "fp8" if args.dtype == "fp8" else resolve_dtype_name(
        args.dtype, shape.checkpoint_dtype, hardware.kind)
    max_model_len = args.max_model_len or shape.max_position_embeddings
    cache, scheduler, device = _configs(args, hardware.kind, max_model_len)
    return PlanSettings(
        hardware.device, devices, hardware.nodes, hardware.intra, hardware.inter,
        max_model_len, FP8_BYTES if dtype == "fp8" else DTYPE_BYTES[dtype],
        cache.gpu_memory_utilization, cache.kv_cache_memory, hardware.device_memory,
        cache.block_size, scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
        cpu_ids=_cores(is_gpu), concurrency=workload.concurrency,
        prompt_len=workload.prompt_len, output_len=workload.output_len,
        quantization=args.quantization,
        shared_weight_copies=keeps_shared_weight_copies(is_gpu, dtype, device.gemm_paths),
        kv_offloading_size=cache.kv_offloading_size, kv_disk_dir=cache.kv_disk_dir,
        kv_disk_size=cache.kv_disk_size)


def machine_settings(config: EngineConfig, device: Device, count: int) -> PlanSettings:
    """The settings of `--strategy auto`: the launch's resolved config on `count` devices of
    this machine (its GPUs, or its cores), one node."""
    dtype = str(config.model.dtype).removeprefix("torch.")
    return PlanSettings(
        device, count, 1, None, INTER_NODE["ib"], config.model.max_model_len,
        DTYPE_BYTES[dtype], config.cache.gpu_memory_utilization, config.cache.kv_cache_memory,
        None, config.cache.block_size, config.scheduler.max_num_seqs,
        config.scheduler.max_num_batched_tokens, cpu_ids=_cores(device.is_gpu),
        quantization=config.model.quantization,
        shared_weight_copies=keeps_shared_weight_copies(device.is_gpu, dtype,
                                                        config.device.gemm_paths),
        kv_offloading_size=config.cache.kv_offloading_size,
        kv_disk_dir=config.cache.kv_disk_dir, kv_disk_size=config.cache.kv_disk_size)


def _configs(args: EngineArgs, kind: str, max_model_len: int
             ) -> tuple[CacheConfig, SchedulerConfig, DeviceConfig]:
    """The cache, scheduler and device configs create_config builds from these flags (its
    defaults for this device kind), validated by their own __post_init__."""
    cache = CacheConfig(args.block_size, args.kv_cache_memory, args.gpu_memory_utilization,
                        args.enable_prefix_caching, args.num_gpu_blocks_override,
                        host_tier_size(args), args.kv_disk_dir, args.kv_disk_size)
    budget = args.max_num_batched_tokens or default_max_num_batched_tokens(
        args.max_num_seqs, kind, None if args.enable_chunked_prefill else max_model_len)
    scheduler = SchedulerConfig(budget, args.max_num_seqs, max_model_len,
                                args.enable_chunked_prefill, args.max_waiting_requests,
                                args.while_asleep)
    device = DeviceConfig(kind, args.num_threads, cpu_kernels=args.cpu_kernels,
                          gemm_paths=gemm_paths(args.gemm_paths, args.cpu_kernels))
    return cache, scheduler, device


def _cores(is_gpu: bool) -> tuple[int, ...] | None:
    """CPU: this machine's cores, as `parashift run` would place the ranks on them."""
    return None if is_gpu else tuple(sorted(os.sched_getaffinity(0)))

"""The user-facing `EngineArgs` and how they become the one resolved `EngineConfig`
(config.py): the strategy from --strategy and vLLM's explicit size flags, the model, dtype,
device, kernels and limits; and how an engine checks that config against its own node.

Importing this module loads no torch: `plan` and the CLI read `EngineArgs` (the one home of
the defaults) without it, so the resolution imports the model and layer modules it needs
when it runs."""

from __future__ import annotations

import functools
import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parashift import env
from parashift.config import (
    GEMM_PATHS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_dtype,
)
from parashift.defaults import (
    ATTENTION_BACKENDS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_HANDOFF_TIER,
    DEFAULT_MAX_NUM_SEQS,
    default_max_num_batched_tokens,
)
from parashift.strategies.pipeline import parse_partition
from parashift.strategies.spec import StrategySpec
from parashift.wire.engine_config import EngineConfigWire, config_from_wire

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    """The user-facing engine knobs (CLI flags and `LLM(...)` keywords), with their defaults
    written once: the CLI options are generated from these fields (cli_options.py) and `plan`
    reads the same defaults. `create_config` below resolves them into the one config. Frozen:
    what a command adds to the user's flags (`run`'s seed, a served queue bound) makes new
    args (`dataclasses.replace`), so these are always what was asked for."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # weight-only int8 / int4 of the linear layers, CPU
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    max_waiting_requests: int | None = None  # per engine; past it a new request is a 429
    # prefill/decode pools (--strategy p1xd1): a pool's own limits (None: the ones above)
    prefill_max_num_batched_tokens: int | None = None
    prefill_max_num_seqs: int | None = None
    decode_max_num_batched_tokens: int | None = None
    decode_max_num_seqs: int | None = None
    enable_chunked_prefill: bool = True
    # Lockstep groups: new prefill work only on every Nth step of a wave (vLLM's name); 1: off
    prefill_schedule_interval: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None
    kv_offloading_size: int | None = None  # bytes of the node's host KV tier (vLLM's flag)
    kv_offloading_backend: str = "native"
    kv_offloading_decode: bool = False  # output tokens' full blocks go to the tier too
    kv_disk_dir: str | None = None  # a disk KV tier, warm across restarts
    kv_disk_size: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    device: str | None = None
    num_threads: int | None = None
    attention_backend: str = "auto"  # auto: triton on CUDA, cpu (compiled kernels) on CPU
    # CPU: our compiled kernels built for this CPU ("native"), for another (a gcc -march: a
    # fleet's oldest CPU, or the AVX2 path tried on a newer one), or "off" (torch ops only)
    cpu_kernels: str = "native"
    # CPU: the GEMM paths load-time timing may choose (comma-separated; None: all of them)
    gemm_paths: str | None = None
    enforce_eager: bool = False  # no CUDA graphs for decode
    # a request's logits and tokens bitwise the same whatever it shares a step with
    # (docs/reproducibility.md): one GEMM path per weight for every row count, every query
    # token through the decode attention kernel
    deterministic: bool = False
    # schedule step N+1 while step N runs; None: where it measured faster (default_async)
    async_scheduling: bool | None = None
    while_asleep: str = "reject"  # a request to a sleeping engine: "reject" (503) or "wait"
    strategy: str | None = None  # e.g. "dp2"; the explicit sizes below must agree with it
    data_parallel_size: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    pp_layer_partition: str | None = None  # layers per pipeline stage, e.g. "10,10,10"
    enable_expert_parallel: bool = False
    # CPU tensor parallel all-reduces through gloo only, not shared memory (to compare, or to
    # rule the shared-memory path out)
    disable_shm_all_reduce: bool = False
    data_parallel_rank: int = 0
    distributed_executor_backend: str = "mp"  # "ray" inside engines run as Ray actors
    # A class (module.Class) mixed into every worker: its methods answer collective_rpc, as
    # vLLM's --worker-extension-cls (measurements from outside the product: scripts/).
    worker_extension_cls: str | None = None


@functools.cache  # once a process: configs are built more than once
def _say_auto_bf16(path: str) -> None:
    logger.info("--dtype auto: bfloat16 for the float32 checkpoint %s, as this CPU multiplies "
                "bf16 natively (--dtype float32 keeps float32)", path)


def strategy_spec(args: EngineArgs) -> StrategySpec:
    """`--strategy` and vLLM's explicit flags are interchangeable; a conflict is an error
    naming both."""
    explicit = {"dp": ("--data-parallel-size", args.data_parallel_size),
                "tp": ("--tensor-parallel-size", args.tensor_parallel_size),
                "pp": ("--pipeline-parallel-size", args.pipeline_parallel_size)}
    ep = args.enable_expert_parallel
    if args.strategy is None:
        spec = StrategySpec.from_sizes(*(v or 1 for _, v in explicit.values()), ep=bool(ep))
        return _with_partition(spec, args.pp_layer_partition)
    spec = StrategySpec.parse(args.strategy)
    for name, (flag, value) in explicit.items():
        if value is not None and value != spec.size(name):
            raise ValueError(f"--strategy {spec} sets {name}={spec.size(name)} but {flag} "
                             f"is {value}")
    if ep and not spec.size("ep"):
        raise ValueError(f"--strategy {spec} has no ep axis but --enable-expert-parallel "
                         "is given")
    return _with_partition(spec, args.pp_layer_partition)


def _with_partition(spec: StrategySpec, partition: str | None) -> StrategySpec:
    if partition is None:
        return spec
    return spec.with_options("pp", partition=parse_partition(partition))


def create_config(args: EngineArgs, spec: StrategySpec | None = None) -> EngineConfig:
    import torch

    from parashift.layers.quantization import check_quantization
    from parashift.models.loader import load_hf_config, resolve_model_path
    from parashift.models.registry import architecture_of, get_model_class

    spec = spec or strategy_spec(args)
    parallel = ParallelConfig(spec, args.data_parallel_rank, args.distributed_executor_backend,
                              shm_all_reduce=not args.disable_shm_all_reduce)
    path = resolve_model_path(args.model)
    hf_config = load_hf_config(path)
    get_model_class(architecture_of(hf_config))
    spec.validate(hf_config)
    device_name = args.device or DeviceConfig().device
    checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(
        hf_config, "torch_dtype", None)
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
    dtype = resolve_dtype(args.dtype, checkpoint_dtype, device_name)
    if args.dtype == "auto" and dtype == torch.bfloat16 and checkpoint_dtype not in (
            torch.float16, torch.bfloat16):
        _say_auto_bf16(path)
    device = DeviceConfig(device_name, args.num_threads, resolve_attention_backend(
        args.attention_backend, device_name, args.block_size, dtype), args.enforce_eager,
        args.cpu_kernels, gemm_paths(args.gemm_paths, args.cpu_kernels), args.deterministic)
    if args.deterministic:
        check_deterministic(device, hf_config, args.quantization, spec, parallel)
    max_model_len = args.max_model_len or getattr(hf_config, "max_position_embeddings", 2048)
    check_quantization(args.quantization, device_name)
    model = ModelConfig(path, hf_config, dtype, max_model_len, args.tokenizer or path,
                        args.seed, args.quantization, args.model)
    scheduler = _scheduler_config(args, spec, device_name, max_model_len)
    return EngineConfig(model, _cache_config(args, spec), scheduler, parallel, device,
                        args.worker_extension_cls)


def _scheduler_config(args: EngineArgs, spec: StrategySpec, device_name: str,
                      max_model_len: int) -> SchedulerConfig:
    budget = args.max_num_batched_tokens or default_max_num_batched_tokens(
        args.max_num_seqs, device_name,
        None if args.enable_chunked_prefill else max_model_len)
    # Decided here once for every process: not with a pipeline (its stages keep their own
    # batches in flight) or lockstep waves (their collectives go one step at a time).
    processes = spec.processes()
    async_scheduling = (
        (args.async_scheduling if args.async_scheduling is not None
         else default_async_scheduling(device_name))
        and processes.max_batches_in_flight == 1 and not processes.lockstep)
    return SchedulerConfig(budget, args.max_num_seqs, max_model_len,
                           args.enable_chunked_prefill, args.max_waiting_requests,
                           args.while_asleep, async_scheduling, *_pool_limits(args, spec),
                           prefill_schedule_interval=_prefill_interval(args, spec))


def _cache_config(args: EngineArgs, spec: StrategySpec) -> CacheConfig:
    """The KV cache and its tiers, refused where the tiers cannot run yet."""
    processes = spec.processes()
    if args.kv_offloading_size and processes.lockstep:
        raise ValueError("--kv-offloading-size is not supported with lockstep expert "
                         "parallel yet")
    if args.kv_offloading_size and args.distributed_executor_backend == "ray":
        # An engine's Ray workers may sit on other nodes than its arena and job board.
        raise ValueError("--kv-offloading-size is not supported with --backend ray yet")
    if processes.prefill_engines:
        _check_pools(args, spec)
    return CacheConfig(args.block_size, args.kv_cache_memory, args.gpu_memory_utilization,
                       args.enable_prefix_caching, args.num_gpu_blocks_override,
                       host_tier_size(args, spec), args.kv_disk_dir, args.kv_disk_size,
                       kv_offloading_decode=args.kv_offloading_decode)


def host_tier_size(args: EngineArgs, spec: StrategySpec | None = None) -> int | None:
    """--kv-offloading-size; prefill/decode pools hand a prompt's KV over through the node's
    host tier, so they have one without it (DEFAULT_HANDOFF_TIER bytes)."""
    if spec is None and args.strategy not in (None, "auto"):
        spec = strategy_spec(args)
    if args.kv_offloading_size or spec is None:
        return args.kv_offloading_size
    return DEFAULT_HANDOFF_TIER if spec.processes().prefill_engines else None


def _pool_limits(args: EngineArgs, spec: StrategySpec) -> tuple[int | None, ...]:
    """The per-pool scheduler limits, refused without pools (they would do nothing)."""
    limits = (args.prefill_max_num_batched_tokens, args.prefill_max_num_seqs,
              args.decode_max_num_batched_tokens, args.decode_max_num_seqs)
    if any(v is not None for v in limits) and not spec.processes().prefill_engines:
        raise ValueError(f"--prefill-*/--decode-* limits apply to prefill/decode pools; "
                         f"--strategy {spec} has none (use pPxdD, like p1xd1)")
    return limits


def _prefill_interval(args: EngineArgs, spec: StrategySpec) -> int:
    """--prefill-schedule-interval aligns the prefills of a lockstep group's ranks; elsewhere
    it would only delay them, so it is refused."""
    interval = args.prefill_schedule_interval
    if interval < 1:
        raise ValueError(f"--prefill-schedule-interval must be >= 1, got {interval}")
    if interval > 1 and not spec.processes().lockstep:
        raise ValueError(f"--prefill-schedule-interval {interval} aligns the prefills of an "
                         f"expert-parallel lockstep group (like dp2xep); --strategy {spec} "
                         "has none")
    return interval


def _check_pools(args: EngineArgs, spec: StrategySpec) -> None:
    """What prefill/decode pools need of the other flags."""
    if args.distributed_executor_backend == "ray":
        raise ValueError(f"--strategy {spec}: prefill/decode pools run with --backend mp "
                         "for now")
    if not args.enable_prefix_caching:
        raise ValueError(f"--strategy {spec}: prefill/decode pools hand prompts over by their "
                         "block hashes: drop --no-enable-prefix-caching")


def check_deterministic(device: DeviceConfig, hf_config: Any, quantization: str | None,
                        spec: StrategySpec, parallel: ParallelConfig) -> None:
    """--deterministic where its guarantee holds, else a clear refusal (what is not made
    batch-invariant yet)."""
    from parashift.strategies.expert import num_experts_of

    if device.device != "cpu":
        raise ValueError("--deterministic runs on CPU for now: the Triton kernels' fixed "
                         "split is later work")
    if device.attention_backend != "cpu" or device.cpu_kernels == "off":
        raise ValueError("--deterministic needs the compiled CPU kernels (--attention-backend "
                         "cpu, --cpu-kernels not off): torch's attention splits a query's "
                         "keys by the batch's shape")
    if quantization:
        raise ValueError(f"--deterministic with --quantization {quantization} is not "
                         "supported yet")
    if spec.size("tp") > 2 and (not parallel.shm_all_reduce
                                or parallel.distributed_executor_backend == "ray"):
        # Two ranks' sum is the same in any order; three or more need the fixed one.
        raise ValueError("--deterministic with tensor parallel over more than 2 ranks needs "
                         "the shared-memory all-reduce (--backend mp, one node, without "
                         "--disable-shm-all-reduce)")
    if num_experts_of(hf_config):
        raise ValueError("--deterministic with a mixture-of-experts model is not supported "
                         "yet: an expert's GEMM runs over the tokens routed to it")


def default_async_scheduling(device: str) -> bool:
    """On CUDA, as vLLM: the GPU runs step N while the host prepares N+1. On CPU the host and
    the "device" share the cores: docs/BENCHMARKS.md ("Async scheduling") has the measurement
    this follows."""
    return device.startswith("cuda")


def gemm_paths(value: str | None, cpu_kernels: str) -> tuple[str, ...]:
    """--gemm-paths as the config records it: every path, or the ones named; our own kernel's
    only with the kernels on."""
    paths = GEMM_PATHS if value is None else tuple(p.strip() for p in value.split(",") if p)
    return tuple(p for p in paths if p != "own-bf16" or cpu_kernels != "off")


def resolve_attention_backend(name: str, device: str, block_size: int,
                              dtype: torch.dtype | None = None) -> str:
    """`auto` -> triton on CUDA (when Triton is installed), the compiled CPU kernels on CPU in
    float32 and bfloat16, torch elsewhere; an explicit choice is checked against the device,
    the dtype (None: float32) and the block size."""
    import torch

    from parashift.layers.kernel_dispatch import has_triton

    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {name!r} is unknown; known: "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    dtype = dtype or torch.float32
    cpu_dtype = dtype in (torch.float32, torch.bfloat16)
    if name == "auto":
        if device.startswith("cuda"):
            return "triton" if has_triton() and block_size >= 16 else "torch"
        return "cpu" if device == "cpu" and cpu_dtype else "torch"
    if name == "cpu" and (device != "cpu" or not cpu_dtype):
        raise ValueError(f"--attention-backend cpu runs on --device cpu in float32 or "
                         f"bfloat16, not on {device} in {str(dtype).removeprefix('torch.')}")
    if name == "triton":
        if not has_triton():
            raise ValueError("--attention-backend triton: Triton is not installed "
                             "(pip install triton)")
        if not device.startswith("cuda") and not env.triton_interpret():
            raise ValueError("--attention-backend triton needs a CUDA device (or "
                             "TRITON_INTERPRET=1, Triton's CPU interpreter, for tests)")
        if block_size < 16:
            raise ValueError(f"--attention-backend triton needs --block-size 16 or more, "
                             f"not {block_size}")
    return name


_PER_FOLDER = {"transformers_version", "_name_or_path"}  # not the model: where and by what


def config_for_this_node(wire: EngineConfigWire) -> EngineConfig:
    """The config the launcher resolved (EngineInit), as this engine runs it, checked against
    this node: its weights (the launcher's path where it exists here and holds the same
    model, else the model the user named, found here; its transformers config must equal the
    launcher's), the device and the attention backend. A mismatch is an error naming this
    node; nothing is resolved again nor silently changed."""
    import torch

    from parashift.models.loader import load_hf_config, resolve_model_path

    node = socket.gethostname()
    model = wire.model
    path = model.path if os.path.isdir(model.path) else resolve_model_path(model.source)
    here = load_hf_config(path).to_dict()
    differ = sorted(key for key in here.keys() | model.hf_config.keys()
                    if key not in _PER_FOLDER and here.get(key) != model.hf_config.get(key))
    if differ:
        raise ValueError(f"node {node}: the model at {path} is not the launcher's ({model.path}):"
                         f" its config differs in {', '.join(differ[:8])}")
    config = config_from_wire(wire, path)
    device = config.device.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"node {node}: the launcher resolved --device {device}, but no CUDA "
                         "device is visible here")
    try:  # what the launcher checked for its own node
        resolve_attention_backend(config.device.attention_backend, device,
                                  config.cache.block_size, config.model.dtype)
    except ValueError as e:
        raise ValueError(f"node {node}: {e}") from None
    return config

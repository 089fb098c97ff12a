"""The numbers of a plan, from the strategy's hooks: the mesh places every rank (and says
where a CPU is oversubscribed), `cost` gives per-device memory and the traffic on each group,
`processes` the replicas; then KV capacity and a roofline estimate of decode / prefill
throughput and per-token latency. The roofline is an estimate, not a measurement."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from parashift.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    default_max_num_batched_tokens,
)
from parashift.plan.bubble import pipeline_bubbles
from parashift.plan.experts import expert_dispatch, expert_options
from parashift.plan.hardware import INTER_NODE, INTRA_NODE, Device, Link
from parashift.plan.kv_tiers import KVTiers, node_kv_tiers
from parashift.plan.shape import ModelShape
from parashift.strategies.layout import DeviceCost, MeshPoint
from parashift.strategies.mesh import DeviceMesh
from parashift.strategies.spec import StrategySpec

CUDA_CONTEXT_BYTES = 1 << 30  # CUDA context, NCCL buffers, allocator slack per GPU
DECODE_CONTEXT = 1024  # tokens of context a decoding sequence holds, for the roofline
LOGIT_BYTES = 4  # logits are sampled in float32


@dataclass(frozen=True)
class PlanSettings:
    device: Device
    devices: int
    nodes: int = 1
    intra: Link | None = None
    inter: Link | None = None
    max_model_len: int | None = None
    dtype_bytes: int = 2
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_memory: int | None = None  # CPU: the KV budget (the engine's default: 2 GiB)
    device_memory: int | None = None  # overrides the device's
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None
    cpu_ids: tuple[int, ...] | None = None  # CPU: the cores of a node (default 0..n-1)
    concurrency: tuple[int, ...] = (1, 4, 32)  # running requests the bubble is estimated at
    prompt_len: int = 512  # the prefill bubble's requests: this prompt,
    output_len: int = 1  # and these output tokens
    quantization: str | None = None  # CPU: weight-only int8 / int4 of the decoder projections
    # CPU: a tied LM head's GEMM keeps its own prepared copy of the embedding (the engine's
    # layers/gemm_paths.py, in float32 and bfloat16)
    shared_weight_copies: bool = False
    kv_offloading_size: int | None = None  # the node's host KV tier (plan/kv_tiers.py)
    kv_disk_dir: str | None = None
    kv_disk_size: int | None = None

    @property
    def devices_per_node(self) -> int:
        return -(-self.devices // self.nodes)

    @property
    def batched_tokens(self) -> int:
        return self.max_num_batched_tokens or default_max_num_batched_tokens(
            self.max_num_seqs, "cuda" if self.device.is_gpu else "cpu")


def keeps_shared_weight_copies(is_gpu: bool, dtype: str, gemm_paths: tuple[str, ...]) -> bool:
    """PlanSettings.shared_weight_copies: the engine's layers/gemm_paths.prepares_shared_weights
    on a CPU with oneDNN (every torch CPU wheel has it); `--gemm-paths linear` leaves a tied
    head on the embedding's own weight."""
    return not is_gpu and dtype in ("float32", "bfloat16") and gemm_paths != ("linear",)


@dataclass
class StageMemory:
    stage: int
    layers: int
    first_layer: int  # the stage's decoder layers are [first_layer, first_layer + layers)
    weights: int
    reserve: int
    kv_cache: int
    free: int
    budget: int
    kv_blocks: int
    kv_tokens: int


@dataclass
class Plan:
    spec: StrategySpec
    shape: ModelShape
    max_model_len: int
    stages: list[StageMemory]
    kv_tokens: int  # per replica: the smallest stage decides
    kv_blocks: int
    concurrent_max_len_seqs: float
    experts_per_rank: int | None
    comm: dict[str, dict[str, float]]
    costs: list[DeviceCost]  # per stage
    mesh: DeviceMesh | None
    estimate: dict[str, float]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    bubble: dict[str, dict[str, float]] = field(default_factory=dict)  # plan/bubble.py
    expert_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # MoE: ep or not
    # ep over engines (plan/experts.py): each node's experts, the dispatch's bytes
    expert_placement: list[dict[str, Any]] = field(default_factory=list)
    dispatch: dict[str, int] | None = None
    kv_tiers: KVTiers | None = None  # plan/kv_tiers.py: the node's host and disk tiers
    ranks_that_fit: int = 0  # dp ranks of this layout the machine holds (elastic dp's ceiling)

    @property
    def fits(self) -> bool:
        return not self.errors

    @property
    def runnable(self) -> bool:
        return self.fits and not self.spec.unavailable()


def plan_mesh(spec: StrategySpec, s: PlanSettings) -> DeviceMesh:
    """The mesh `run` would build: GPUs by index, or the cores of a CPU node."""
    if s.device.is_gpu:
        return DeviceMesh(spec, s.devices_per_node, "cuda", s.nodes)
    cores = s.cpu_ids or tuple(range(s.devices_per_node))
    return DeviceMesh(spec, len(cores), "cpu", s.nodes, cpu_ids=list(cores))


def stage_points(spec: StrategySpec) -> list[MeshPoint]:
    """The first worker of every pipeline stage of one engine (the workers of a stage hold
    equal shares, up to kv heads shared by several tp ranks)."""
    sizes = spec.sizes()
    return [MeshPoint({name: (stage if name == "pp" else 0) for name in sizes}, sizes)
            for stage in range(sizes.get("pp", 1))]


def stage_costs(shape: ModelShape, spec: StrategySpec) -> list[DeviceCost]:
    """The cost hook's answer for each stage_points worker."""
    hf_config = shape.as_hf_config()
    return [spec.cost(shape.whole_model_cost(), at, hf_config) for at in stage_points(spec)]


def activation_reserve(cost: DeviceCost, shape: ModelShape, s: PlanSettings) -> int:
    """Peak activations of the largest step plus the logits of a full decode batch (on the
    stage with the LM head)."""
    logits = s.max_num_seqs * shape.vocab_size * LOGIT_BYTES if cost.has_final_norm else 0
    extra = CUDA_CONTEXT_BYTES if s.device.is_gpu else 0
    return s.batched_tokens * cost.activation_values_per_token() * s.dtype_bytes + logits + extra


def kv_block_bytes(cost: DeviceCost, s: PlanSettings) -> int:
    """One KV block of this worker's layers, K and V (the worker's kv_block_bytes)."""
    return s.block_size * cost.kv_values_per_token() * s.dtype_bytes


def make_plan(shape: ModelShape, spec: StrategySpec, s: PlanSettings) -> Plan:
    errors = [f"strategy {spec}: {e}" for e in spec.model_errors(shape.as_hf_config())]
    warnings = list(spec.unavailable())
    if spec.world_size > s.devices:
        errors.append(f"{spec} needs {spec.world_size} devices; --devices is {s.devices}")
    elif spec.world_size < s.devices:
        warnings.append(f"{spec} uses {spec.world_size} of the {s.devices} devices")
    mesh = None
    if spec.world_size <= s.devices:
        try:
            mesh = plan_mesh(spec, s)
            warnings += mesh.warnings
        except ValueError as e:
            errors.append(str(e))
    max_len = s.max_model_len or shape.max_position_embeddings
    memory = s.device_memory or s.device.memory_bytes
    costs = stage_costs(shape, spec)
    first_layers = [(spec.shard(at, shape.as_hf_config()).layers or (0,))[0]
                    for at in stage_points(spec)]
    stages = []
    for stage, cost in enumerate(costs):
        weights = cost.weight_bytes(s.dtype_bytes, s.quantization)
        if s.shared_weight_copies and cost.tied_head:
            weights += cost.vocab_rows * cost.hidden_size * s.dtype_bytes
        reserve = activation_reserve(cost, shape, s)
        block_bytes = kv_block_bytes(cost, s)
        if s.device.is_gpu:
            budget = int(memory * s.gpu_memory_utilization)
            kv = max(0, budget - weights - reserve)
            free = memory - budget
        else:  # the engine's CPU rule: the KV budget is its own, apart from the weights
            kv = s.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
            budget = weights + reserve + kv
            free = memory - budget
        blocks = kv // block_bytes if block_bytes else 0
        stages.append(StageMemory(stage, cost.layers, first_layers[stage], weights, reserve,
                                  blocks * block_bytes,
                                  free, budget, blocks, blocks * s.block_size))
        if s.device.is_gpu and weights + reserve > budget:
            errors.append(
                f"does not fit: stage {stage} needs {weights / 2**30:.1f} GiB of weights + "
                f"{reserve / 2**30:.1f} GiB reserve per device, the budget is "
                f"{budget / 2**30:.1f} GiB ({s.gpu_memory_utilization:g} x "
                f"{memory / 2**30:.0f} GiB)")
        elif free < 0:
            errors.append(f"does not fit: stage {stage} needs {budget / 2**30:.1f} GiB, the "
                          f"device has {memory / 2**30:.1f} GiB")
    kv_blocks = min(st.kv_blocks for st in stages)
    kv_tokens = kv_blocks * s.block_size
    if not errors and kv_tokens < max_len:
        errors.append(f"KV cache below one max-length sequence: {kv_tokens} tokens per "
                      f"replica < max_model_len {max_len} (lower --max-model-len, or spread "
                      "the model over more devices)")
    experts = max(c.experts_held for c in costs) if shape.is_moe else None
    comm = communication(costs, s.dtype_bytes)
    if mesh is not None:
        for name in sorted({g for c in costs for g in c.traffic}):
            if mesh.group_spans_nodes(name):
                warnings.append(f"the {name} group crosses nodes ({s.devices_per_node} devices "
                                f"per node): its collectives go over {_inter(s).name}")
    plan = Plan(spec, shape, max_len, stages, kv_tokens, kv_blocks, kv_tokens / max_len,
                experts, comm, costs, mesh, {}, errors, warnings)
    plan.kv_tiers, tier_errors = node_kv_tiers(
        max(kv_block_bytes(c, s) for c in costs), spec.processes(), mesh, s.kv_offloading_size,
        s.kv_disk_size, s.kv_disk_dir, s.block_size)
    errors += tier_errors
    plan.ranks_that_fit = ranks_that_fit(stages, spec, s)
    plan.estimate = roofline(plan, s)
    plan.expert_options = expert_options(shape, spec, s.dtype_bytes, s.quantization)
    plan.expert_placement, plan.dispatch = expert_dispatch(shape, spec, mesh, s.dtype_bytes)
    plan.bubble = (pipeline_bubbles(costs, s.prompt_len, s.output_len, s.concurrency,
                                   s.batched_tokens)
                   if len(costs) > 1 else {})
    if len(stages) > 1 and plan.estimate and plan.estimate["decode_batch"] < 4 * len(stages):
        warnings.append(f"{len(stages)} pipeline stages: with "
                        f"{plan.estimate['decode_batch']:.0f} sequences per replica "
                        "the pipeline has bubbles (needs several micro-batches per stage)")
    return plan


def ranks_that_fit(stages: list[StageMemory], spec: StrategySpec, s: PlanSettings) -> int:
    """How many dp ranks of this layout (one engine and its workers each) the machine holds:
    on GPUs, as many as its devices seat (each device's budget is checked per stage); on a
    CPU, all ranks share its memory, each taking every worker's weights, reserve and KV."""
    workers = spec.processes().workers_per_engine
    if s.device.is_gpu:
        return s.devices // workers
    per_stage_workers = workers // len(stages)
    per_rank = sum(st.budget for st in stages) * per_stage_workers
    memory = s.device_memory or s.device.memory_bytes
    return memory // per_rank if per_rank else 0


def _inter(s: PlanSettings) -> Link:
    return s.inter or INTER_NODE["ib"]


def _intra(s: PlanSettings) -> Link:
    return s.intra or INTRA_NODE["nvlink" if s.device.is_gpu else "shm"]


def communication(costs: list[DeviceCost], dtype_bytes: int) -> dict[str, dict[str, float]]:
    """Per device and step, what each group moves (the busiest stage's figures)."""
    out: dict[str, dict[str, float]] = {}
    for cost in costs:
        for name, t in cost.traffic.items():
            row = {"group_size": t.group_size, "count_per_step": t.count_per_step,
                   "bytes_per_token": t.values_per_token * dtype_bytes}
            if t.values_per_sequence:
                row["bytes_per_sequence"] = t.values_per_sequence * LOGIT_BYTES
            key = f"{name} {t.kind}"
            if key not in out or row["bytes_per_token"] > out[key]["bytes_per_token"]:
                out[key] = row
    return out


def _comm_seconds(plan: Plan, s: PlanSettings, cost: DeviceCost, tokens: int) -> float:
    total = 0.0
    for name, t in cost.traffic.items():
        crosses = plan.mesh is not None and plan.mesh.group_spans_nodes(name)
        link = _inter(s) if crosses else _intra(s)
        moved = tokens * t.values_per_token * s.dtype_bytes
        if t.kind == "all-reduce":
            # Small all-reduces go tree-like (NCCL's LL protocols): latency grows with log2.
            total += (t.count_per_step * 2 * math.ceil(math.log2(t.group_size)) * link.latency
                      + 2 * (t.group_size - 1) / t.group_size * moved / link.bandwidth)
        else:  # all-to-all, send/recv: one latency per call, the bytes once
            total += t.count_per_step * link.latency + moved / link.bandwidth
    return total


def roofline(plan: Plan, s: PlanSettings) -> dict[str, float]:
    """Decode and prefill throughput of all replicas and the decode time per output token:
    each stage takes max(memory time, compute time) plus its communication."""
    if not plan.fits:
        return {}
    shape, processes = plan.shape, plan.spec.processes()
    depth = len(plan.stages)
    ctx = min(plan.max_model_len, DECODE_CONTEXT)
    batch = max(1, min(s.max_num_seqs, plan.kv_tokens // ctx))
    active_per_device = shape.active_params() / processes.workers_per_engine

    def stage_time(tokens: int, kv_tokens: int) -> float:
        worst = 0.0
        for cost in plan.costs:
            weights = cost.weight_bytes(s.dtype_bytes, s.quantization)
            if shape.is_moe:  # a small batch reads only the experts its tokens pick
                touched = min(1.0, tokens * shape.num_experts_per_tok / shape.num_experts)
                weights -= cost.expert_weight_params() * s.dtype_bytes * (1 - touched)
            kv_read = kv_tokens * cost.kv_values_per_token() * s.dtype_bytes
            t_mem = (weights + kv_read) / s.device.memory_bw
            t_cmp = 2 * tokens * active_per_device / s.device.bf16_flops
            worst = max(worst, max(t_mem, t_cmp) + _comm_seconds(plan, s, cost, tokens))
        return worst

    t_decode = stage_time(batch, batch * ctx)
    tpot = depth * t_decode
    single = depth * stage_time(1, ctx)  # one sequence alone: the latency floor
    # With at least one micro-batch per stage in flight every stage stays busy.
    per_replica = batch / t_decode if batch >= depth else batch / tpot
    prefill_tokens = s.batched_tokens
    t_prefill = stage_time(prefill_tokens, prefill_tokens)
    return {"decode_batch": batch, "decode_context": ctx, "tpot_ms": tpot * 1e3,
            "tpot_single_ms": single * 1e3,
            "decode_tokens_per_s": processes.num_engines * per_replica,
            "prefill_tokens_per_s": processes.num_engines * prefill_tokens / t_prefill}

"""The numbers of a plan: per-device memory (weights share, reserve, KV cache), KV capacity,
per-step communication, and a roofline estimate of decode / prefill throughput and per-token
latency. Every formula follows how the engine lays the model out (layers/linear.py,
layers/embedding.py, executor/worker.py); the roofline is an estimate, not a measurement."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parashift.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEFAULT_MAX_NUM_SEQS,
    default_max_num_batched_tokens,
)
from parashift.plan.hardware import INTER_NODE, INTRA_NODE, Device, Link
from parashift.plan.shape import ModelShape, layers_of_stage
from parashift.strategies.spec import StrategySpec

CUDA_CONTEXT_BYTES = 1 << 30  # CUDA context, NCCL buffers, allocator slack per GPU
DECODE_CONTEXT = 1024  # tokens of context a decoding sequence holds, for the roofline


@dataclass(frozen=True)
class PlanSettings:
    device: Device
    devices: int
    nodes: int = 1
    intra: Link | None = None
    inter: Link | None = None
    max_model_len: int | None = None
    dtype_bytes: int = 2
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # CPU: the KV budget (the engine's default: 2 GiB)
    device_memory: int | None = None  # overrides the device's
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None

    @property
    def devices_per_node(self) -> int:
        return -(-self.devices // self.nodes)

    @property
    def batched_tokens(self) -> int:
        return self.max_num_batched_tokens or default_max_num_batched_tokens(self.max_num_seqs)


@dataclass
class StageMemory:
    stage: int
    layers: int
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
    estimate: dict[str, float]
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.errors

    @property
    def runnable(self) -> bool:
        return self.fits and not self.spec.unavailable()


def weights_per_device(shape: ModelShape, spec: StrategySpec, stage: int, dtype_bytes: int
                       ) -> int:
    """Bytes of one tp rank of pipeline stage `stage` (the ranks of a stage hold equal
    shares, up to replicated kv heads which every rank holds)."""
    tp, pp = spec.size("tp"), spec.size("pp")
    ep = spec.size("dp") * tp if spec.size("ep") else 1
    layers = layers_of_stage(shape.num_layers, pp, stage)
    first = sum(layers_of_stage(shape.num_layers, pp, s) for s in range(stage))
    moe_layers = sum(1 for i in range(first, first + layers) if i >= shape.first_dense_layers
                     and shape.is_moe)
    h = shape.hidden_size
    if shape.is_mla:
        attention = shape.attention_params() // tp
    else:
        d, kv = shape.head_dim, shape.kv_heads_per_rank(tp)
        attention = 2 * h * shape.num_heads * d // tp + 2 * h * kv * d
    params = layers * (attention + 2 * h)  # + the two norms
    params += (layers - moe_layers) * shape.dense_mlp_params() // tp
    if moe_layers:
        routed = (-(-shape.num_experts // ep) * shape.expert_params() if ep > 1
                  else shape.num_experts * shape.expert_params() // tp)
        shared = shape.num_shared_experts * shape.expert_params() // tp
        params += moe_layers * (routed + shared + h * shape.num_experts)
    vocab_rows = -(-shape.vocab_size // tp) * h  # padded: equal rows on every rank
    if stage == 0:
        params += vocab_rows
    if stage == pp - 1 and not (shape.tie_word_embeddings and pp == 1):
        params += vocab_rows
    return params * dtype_bytes


def activation_reserve(shape: ModelShape, spec: StrategySpec, s: PlanSettings) -> int:
    """Peak activations of the largest step plus the logits of a full decode batch."""
    tp = spec.size("tp")
    per_token = (4 * shape.hidden_size + (shape.num_heads + 2 * shape.num_kv_heads)
                 * shape.head_dim // tp + 2 * max(shape.intermediate_size,
                                                   shape.moe_intermediate_size) // tp)
    logits = s.max_num_seqs * shape.vocab_size * 4
    extra = CUDA_CONTEXT_BYTES if s.device.is_gpu else 0
    return s.batched_tokens * per_token * s.dtype_bytes + logits + extra


def make_plan(shape: ModelShape, spec: StrategySpec, s: PlanSettings) -> Plan:
    tp, pp, dp = spec.size("tp"), spec.size("pp"), spec.size("dp")
    errors = [f"strategy {spec}: {e}" for e in spec.model_errors(shape.as_hf_config())]
    warnings = list(spec.unavailable())
    if spec.world_size > s.devices:
        errors.append(f"{spec} needs {spec.world_size} devices; --devices is {s.devices}")
    elif spec.world_size < s.devices:
        warnings.append(f"{spec} uses {spec.world_size} of the {s.devices} devices")
    max_len = s.max_model_len or shape.max_position_embeddings
    memory = s.device_memory or s.device.memory_bytes
    stages = []
    for stage in range(pp):
        layers = layers_of_stage(shape.num_layers, pp, stage)
        weights = weights_per_device(shape, spec, stage, s.dtype_bytes)
        reserve = activation_reserve(shape, spec, s)
        block_bytes = s.block_size * shape.kv_bytes_per_token(tp, layers, s.dtype_bytes)
        if s.device.is_gpu:
            budget = int(memory * s.gpu_memory_utilization)
            kv = max(0, budget - weights - reserve)
            free = memory - budget
        else:  # the engine's CPU rule: the KV budget is its own, apart from the weights
            kv = s.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
            budget = weights + reserve + kv
            free = memory - budget
        blocks = kv // block_bytes if block_bytes else 0
        stages.append(StageMemory(stage, layers, weights, reserve, blocks * block_bytes,
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
    experts = None
    if shape.is_moe:
        experts = (-(-shape.num_experts // (dp * tp)) if spec.size("ep")
                   else shape.num_experts)
    if tp > s.devices_per_node:
        warnings.append(f"tp{tp} crosses nodes ({s.devices_per_node} devices per node): every "
                        f"layer's all-reduces go over {_inter(s).name}")
    plan = Plan(spec, shape, max_len, stages, kv_tokens, kv_blocks, kv_tokens / max_len,
                experts, communication(shape, spec, s), {}, errors, warnings)
    plan.estimate = roofline(plan, s)
    if pp > 1 and plan.estimate.get("decode_batch", 0) < 4 * pp:
        warnings.append(f"pp{pp}: with {plan.estimate.get('decode_batch', 0):.0f} sequences "
                        "per replica the pipeline has bubbles (needs several micro-batches "
                        "per stage)")
    return plan


def _inter(s: PlanSettings) -> Link:
    return s.inter or INTER_NODE["ib"]


def _intra(s: PlanSettings) -> Link:
    return s.intra or INTRA_NODE["nvlink" if s.device.is_gpu else "shm"]


def communication(shape: ModelShape, spec: StrategySpec, s: PlanSettings
                  ) -> dict[str, dict[str, float]]:
    """Per replica and per token, what each axis moves every step."""
    tp, pp = spec.size("tp"), spec.size("pp")
    h, b = shape.hidden_size, s.dtype_bytes
    out: dict[str, dict[str, float]] = {}
    if tp > 1:
        count = 2 * shape.num_layers + 1  # o_proj and down_proj per layer, the embedding
        out["tp all-reduce"] = {
            "count_per_step": count, "bytes_per_token": count * h * b,
            "sent_per_device_per_token": count * h * b * 2 * (tp - 1) / tp,
            "lm_head_gather_per_sequence": (tp - 1) * -(-shape.vocab_size // tp) * 4}
    if pp > 1:
        out["pp send/recv"] = {"count_per_step": pp - 1, "bytes_per_token": (pp - 1) * h * b}
    if spec.size("ep") and shape.is_moe:
        ep = spec.size("dp") * tp
        per_layer = 2 * shape.num_experts_per_tok * h * b * (ep - 1) / ep  # dispatch + combine
        out["ep all-to-all"] = {"count_per_step": 2 * shape.moe_layers,
                                "bytes_per_token": shape.moe_layers * per_layer}
    return out


def roofline(plan: Plan, s: PlanSettings) -> dict[str, float]:
    """Decode and prefill throughput of all replicas and the decode time per output token:
    each stage takes max(memory time, compute time) plus its communication."""
    if not plan.fits:
        return {}
    shape, spec = plan.shape, plan.spec
    dp, tp, pp = spec.size("dp"), spec.size("tp"), spec.size("pp")
    ctx = min(plan.max_model_len, DECODE_CONTEXT)
    batch = max(1, min(s.max_num_seqs, plan.kv_tokens // ctx))
    tp_link = _inter(s) if tp > s.devices_per_node else _intra(s)
    ep_size = dp * tp if spec.size("ep") else 1
    ep_link = _inter(s) if ep_size > s.devices_per_node else _intra(s)
    pp_link = _inter(s) if s.nodes > 1 and pp > 1 else _intra(s)
    active_per_device = shape.active_params() / (tp * pp)
    ar_count = (2 * shape.num_layers + 1) / pp if tp > 1 else 0

    def stage_time(tokens: int, kv_tokens: int) -> float:
        weights = max(st.weights for st in plan.stages)
        if shape.is_moe:  # a small batch reads only the experts its tokens pick
            touched = min(1.0, tokens * shape.num_experts_per_tok / shape.num_experts)
            expert_bytes = (shape.moe_layers / pp * shape.num_experts * shape.expert_params()
                            * s.dtype_bytes / max(tp, ep_size))
            weights -= expert_bytes * (1 - touched)
        kv_read = kv_tokens * shape.kv_bytes_per_token(tp, shape.num_layers // pp,
                                                       s.dtype_bytes)
        t_mem = (weights + kv_read) / s.device.memory_bw
        t_cmp = 2 * tokens * active_per_device / s.device.bf16_flops
        t_comm = 0.0
        if tp > 1:
            # Small all-reduces go tree-like (NCCL's LL protocols): latency grows with log2(tp).
            t_comm += ar_count * (2 * math.ceil(math.log2(tp)) * tp_link.latency
                                  + 2 * (tp - 1) / tp * tokens * shape.hidden_size
                                  * s.dtype_bytes / tp_link.bandwidth)
        if ep_size > 1 and shape.is_moe:
            t_comm += (2 * shape.moe_layers / pp) * (ep_link.latency + tokens
                                                     * shape.num_experts_per_tok
                                                     * shape.hidden_size * s.dtype_bytes
                                                     / ep_link.bandwidth)
        if pp > 1:
            t_comm += pp_link.latency + tokens * shape.hidden_size * s.dtype_bytes / (
                pp_link.bandwidth)
        return max(t_mem, t_cmp) + t_comm

    t_decode = stage_time(batch, batch * ctx)
    tpot = pp * t_decode
    single = pp * stage_time(1, ctx)  # one sequence alone: the latency floor
    # With at least pp micro-batches in flight every stage stays busy; with fewer, it idles.
    per_replica = batch / t_decode if batch >= pp else batch / tpot
    prefill_tokens = s.batched_tokens
    t_prefill = stage_time(prefill_tokens, prefill_tokens)
    return {"decode_batch": batch, "decode_context": ctx, "tpot_ms": tpot * 1e3,
            "tpot_single_ms": single * 1e3,
            "decode_tokens_per_s": dp * per_replica,
            "prefill_tokens_per_s": dp * prefill_tokens / t_prefill}

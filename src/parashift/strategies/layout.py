"""What the strategy hooks answer, as plain data: a mesh axis, a named process group, the shard
plan the parallel layers read at load time, the processes a launch needs, and what one device
holds and moves (for `plan`). No torch here: the planner imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

from parashift.defaults import QUANTIZED_PARAM_BYTES, QUANTIZED_ROW_BYTES


@dataclass(frozen=True)
class MeshAxis:
    """One dimension of the device mesh. `spans_engines`: one engine per coordinate (dp);
    otherwise the axis lives inside one engine, as its worker processes (tp, pp)."""

    name: str
    size: int
    spans_engines: bool


@dataclass(frozen=True)
class GroupSpec:
    """A process group per combination of the other coordinates: the ranks that differ only
    along `axes` (tp: ("tp",); ep: ("dp", "tp"))."""

    name: str
    axes: tuple[str, ...]


@dataclass(frozen=True)
class MeshPoint:
    """One rank's coordinates on every mesh axis, and every axis's size."""

    coords: dict[str, int]
    sizes: dict[str, int]


@dataclass(frozen=True)
class ShardPlan:
    """How one rank's share of the model is cut; the parallel layers read it while loading.
    Every field is at its whole-model value until an axis narrows it."""

    tp_rank: int = 0
    tp_size: int = 1  # column/row splits of the linears, vocabulary rows
    layers: tuple[int, int] | None = None  # [first, end) of the decoder layers; None: all
    has_embedding: bool = True
    has_lm_head: bool = True
    ep_rank: int = 0
    ep_size: int = 1
    experts: tuple[int, int] | None = None  # [first, end) of the routed experts; None: all


@dataclass(frozen=True)
class ProcessPlan:
    """What a launch runs. `workers_per_engine` 1: the engine process runs the model itself.
    `reserved_cpus`: the first cores of each CPU node, kept for the API servers (and the
    launcher) instead of the engines."""

    num_engines: int = 1
    workers_per_engine: int = 1
    coordinator: bool = False
    lockstep: bool = False  # every engine runs every step (expert parallel waves)
    reserved_cpus: int = 0
    max_batches_in_flight: int = 1  # steps an engine submits before the oldest answers
    # Prefill/decode pools: engines 0..prefill_engines-1 prefill, the rest decode (0: none).
    prefill_engines: int = 0


@dataclass(frozen=True)
class Traffic:
    """What one step moves on one process group, per device: `count_per_step` collectives
    carrying `values_per_token` values in all for every token of the step, plus
    `values_per_sequence` for every sampled row."""

    group_size: int
    count_per_step: int
    values_per_token: float
    kind: str = "all-reduce"  # all-reduce | send/recv | all-to-all | gather
    values_per_sequence: float = 0.0


@dataclass
class DeviceCost:
    """The shapes one device holds and what it moves per step. It starts as the whole model on
    one device (`ModelShape.whole_model_cost`); each axis's `cost` hook narrows the dimensions
    its shard plan splits and adds the traffic on its groups. The parameter count follows how
    the parallel layers allocate (layers/linear.py, layers/embedding.py)."""

    hidden_size: int
    head_dim: int
    num_heads: int  # q heads held
    num_kv_heads: int  # kv heads held (a kv head shared by several tp ranks counts on each)
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    intermediate_size: int  # dense MLP columns held
    layers: int
    moe_layers: int
    dense_layer_ids: tuple[int, ...]  # MoE models: the layers that keep a dense MLP
    num_experts: int  # routed experts of the model (the router scores all of them)
    num_experts_per_tok: int
    experts_held: int  # routed experts held, per MoE layer
    moe_intermediate_size: int  # columns of one routed expert held
    shared_intermediate_size: int  # columns of the shared experts held
    shared_expert_gate: bool  # Qwen2-MoE: a 1-row sigmoid gate on the shared expert
    vocab_rows: int  # padded vocabulary rows of one embedding / LM head on this device
    has_embedding: bool
    has_lm_head: bool  # its own LM head weight (not tied to an embedding on this device)
    has_final_norm: bool
    mla_attention_params: int = 0  # MLA models: attention parameters per layer held
    mla_kv_values: int = 0  # MLA models: latent + rope key values per token and layer
    traffic: dict[str, Traffic] = field(default_factory=dict)

    def attention_params(self) -> int:
        if self.mla_attention_params:
            return self.mla_attention_params
        h, d = self.hidden_size, self.head_dim
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        params = qkv * h + self.num_heads * d * h
        params += qkv if self.qkv_bias else 0
        params += h if self.o_bias else 0
        return params + (2 * d if self.qk_norm else 0)

    def weight_params(self) -> int:
        h = self.hidden_size
        dense = self.layers - self.moe_layers
        moe = (3 * h * (self.experts_held * self.moe_intermediate_size
                        + self.shared_intermediate_size) + h * self.num_experts
               + (h if self.shared_expert_gate else 0))
        rows = self.vocab_rows * ((1 if self.has_embedding else 0)
                                  + (1 if self.has_lm_head else 0))
        return (self.layers * (self.attention_params() + 2 * h)
                + dense * 3 * h * self.intermediate_size + self.moe_layers * moe
                + rows * h + (h if self.has_final_norm else 0))

    @property
    def tied_head(self) -> bool:
        """The LM head on this device is the embedding's weight (tied)."""
        return self.has_embedding and self.has_final_norm and not self.has_lm_head

    def quantized_params(self) -> int:
        """The parameters `--quantization` quantizes (layers/quantization.py): the decoder
        layers' attention and MLP projections, a shared expert's too; not the routed experts,
        the norms, biases, embedding or LM head."""
        h, d = self.hidden_size, self.head_dim
        attention = self.mla_attention_params or (
            (self.num_heads + 2 * self.num_kv_heads) * d * h + self.num_heads * d * h)
        dense = self.layers - self.moe_layers
        return (self.layers * attention + dense * 3 * h * self.intermediate_size
                + self.moe_layers * 3 * h * self.shared_intermediate_size)

    def quantized_rows(self) -> int:
        """Output rows of the quantized projections (int8 keeps a scale per row); MLA's
        projections are left out."""
        if self.mla_attention_params:
            return 0
        h, d = self.hidden_size, self.head_dim
        attention = (self.num_heads + 2 * self.num_kv_heads) * d + h
        dense = self.layers - self.moe_layers
        shared = 2 * self.shared_intermediate_size + h if self.shared_intermediate_size else 0
        return (self.layers * attention + dense * (2 * self.intermediate_size + h)
                + self.moe_layers * shared)

    def weight_bytes(self, dtype_bytes: int, quantization: str | None = None) -> int:
        """The weights' bytes on this device, in the model's dtype or quantized."""
        full = self.weight_params() * dtype_bytes
        if quantization is None:
            return full
        return int(full - self.quantized_params() * (dtype_bytes
                                                     - QUANTIZED_PARAM_BYTES[quantization])
                   + self.quantized_rows() * QUANTIZED_ROW_BYTES[quantization])

    def expert_weight_params(self) -> int:
        return self.moe_layers * self.experts_held * 3 * self.hidden_size * (
            self.moe_intermediate_size)

    def kv_values_per_token(self) -> int:
        """K and V values one token stores on this device, over its layers."""
        per_layer = self.mla_kv_values or 2 * self.num_kv_heads * self.head_dim
        return self.layers * per_layer

    def activation_values_per_token(self) -> int:
        """Live activations of one token of the largest step."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return 4 * self.hidden_size + qkv + 2 * max(self.intermediate_size,
                                                    self.moe_intermediate_size)

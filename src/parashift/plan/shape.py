"""What `parashift plan` needs to know about a model: its shape, from a Hugging Face config
(folder, bare config.json, GGUF) or a preset, and the sizes derived from it -- parameters per
part, KV bytes per token -- counted the way the engine lays them out over tp ranks."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from parashift.strategies.layout import DeviceCost


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers)
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    num_experts: int = 0  # MoE: routed experts per MoE layer
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0  # DeepSeek: shared experts of moe_intermediate_size each
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one gated shared expert this wide
    first_dense_layers: int = 0  # DeepSeek: the first k layers have a dense MLP
    mlp_only_layers: tuple[int, ...] = ()  # Qwen-MoE: these layers stay dense, and only
    decoder_sparse_step: int = 1  # every step-th layer is sparse (models/moe_model.py)
    # Multi-head latent attention (DeepSeek): the cache holds one latent per token and layer.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # As the engine builds the layers (models/llama.py and its subclasses).
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    checkpoint_dtype: str | None = "bfloat16"  # what --dtype auto starts from

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def dense_layer_ids(self) -> tuple[int, ...]:
        if not self.is_moe:
            return tuple(range(self.num_layers))
        return tuple(i for i in range(self.num_layers)
                     if i < self.first_dense_layers or i in self.mlp_only_layers
                     or (i + 1) % self.decoder_sparse_step)

    @property
    def moe_layers(self) -> int:
        return self.num_layers - len(self.dense_layer_ids)

    @property
    def shared_intermediate_size(self) -> int:
        return (self.shared_expert_intermediate_size
                or self.num_shared_experts * self.moe_intermediate_size)

    # --- parameters ---------------------------------------------------------------------------
    def attention_params(self) -> int:
        h, n, k, d = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * n * qk if self.q_lora_rank
                 else h * n * qk)
            kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim)
                  + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim))
            return q + kv + n * self.v_head_dim * h
        return h * n * d + 2 * h * k * d + n * d * h

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def expert_params(self) -> int:
        """One routed expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        h = self.hidden_size
        moe = self.moe_layers * (self.num_experts * self.expert_params()
                                 + 3 * h * self.shared_intermediate_size)
        gates = 1 if self.shared_expert_intermediate_size else 0
        router = self.moe_layers * h * (self.num_experts + gates)
        dense = (self.num_layers - self.moe_layers) * self.dense_mlp_params()
        heads = self.embedding_params() * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.attention_params() + moe + router + dense + heads

    def active_params(self) -> int:
        """Parameters one token's forward pass touches (MoE: only its top-k experts)."""
        if not self.is_moe:
            return self.total_params()
        idle = self.num_experts - self.num_experts_per_tok
        return self.total_params() - self.moe_layers * idle * self.expert_params()

    def whole_model_cost(self) -> DeviceCost:
        """The whole model on one device: what the strategy's cost hooks start from."""
        return DeviceCost(
            hidden_size=self.hidden_size, head_dim=self.head_dim, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, qkv_bias=self.qkv_bias, o_bias=self.o_bias,
            qk_norm=self.qk_norm, intermediate_size=self.intermediate_size,
            layers=self.num_layers, moe_layers=self.moe_layers,
            dense_layer_ids=self.dense_layer_ids, num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok, experts_held=self.num_experts,
            moe_intermediate_size=self.moe_intermediate_size if self.is_moe else 0,
            shared_intermediate_size=self.shared_intermediate_size,
            shared_expert_gate=bool(self.shared_expert_intermediate_size),
            vocab_rows=self.vocab_size, has_embedding=True,
            has_lm_head=not self.tie_word_embeddings, has_final_norm=True,
            mla_attention_params=self.attention_params() if self.is_mla else 0,
            # one latent + rope key per token, replicated on every tp rank
            mla_kv_values=self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else 0)

    def as_hf_config(self) -> Any:
        """The attributes the strategies validate against."""
        return SimpleNamespace(num_attention_heads=self.num_heads,
                               num_key_value_heads=self.num_kv_heads,
                               intermediate_size=self.intermediate_size or None,
                               num_hidden_layers=self.num_layers,
                               num_experts=self.num_experts or None, vocab_size=self.vocab_size)


def from_hf_config(cfg: Any, name: str) -> ModelShape:
    """Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral and DeepSeek-V3-style configs."""
    heads = cfg.num_attention_heads
    arch = (getattr(cfg, "architectures", None) or [""])[0]
    bias = bool(getattr(cfg, "attention_bias", False))
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    experts = (getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
               or getattr(cfg, "n_routed_experts", None) or 0)
    return ModelShape(
        name=name, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
        num_heads=heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        intermediate_size=getattr(cfg, "intermediate_size", 0) or 0,
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 4096) or 4096,
        num_experts=experts,
        num_experts_per_tok=getattr(cfg, "num_experts_per_tok", 0) or 0,
        moe_intermediate_size=(getattr(cfg, "moe_intermediate_size", None)
                               or (cfg.intermediate_size if experts else 0)),
        num_shared_experts=getattr(cfg, "n_shared_experts", 0) or 0,
        shared_expert_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0)
        or 0,
        first_dense_layers=getattr(cfg, "first_k_dense_replace", 0) or 0,
        mlp_only_layers=tuple(getattr(cfg, "mlp_only_layers", None) or ()),
        decoder_sparse_step=getattr(cfg, "decoder_sparse_step", 1) or 1,
        kv_lora_rank=getattr(cfg, "kv_lora_rank", 0) or 0,
        q_lora_rank=getattr(cfg, "q_lora_rank", 0) or 0,
        qk_rope_head_dim=getattr(cfg, "qk_rope_head_dim", 0) or 0,
        qk_nope_head_dim=getattr(cfg, "qk_nope_head_dim", 0) or 0,
        v_head_dim=getattr(cfg, "v_head_dim", 0) or 0,
        qkv_bias=bias or arch.startswith("Qwen2"), o_bias=bias,
        qk_norm=arch.startswith("Qwen3"), checkpoint_dtype=str(dtype) if dtype else None,
    )

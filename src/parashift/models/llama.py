"""The Llama family (Llama 2/3, Mistral, SmolLM2), written once against the parallel layers.
Qwen2 and Qwen3 are the same network with a few switches (see qwen2.py, qwen3.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from parashift.distributed.parallel_context import ParallelContext
from parashift.layers.activation import silu_and_mul
from parashift.layers.attention.backend import AttentionBackend
from parashift.layers.attention.layer import Attention
from parashift.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from parashift.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from parashift.layers.norm import RMSNorm
from parashift.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from parashift.layers.weights import WeightSource


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, backend: AttentionBackend,
                 parallel: ParallelContext, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, cfg.num_attention_heads,
                                          num_kv_heads, qkv_bias, dtype, parallel)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * head_dim, cfg.hidden_size,
                                        o_bias, dtype, parallel)
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5,
                              backend)

    def forward(self, hidden: torch.Tensor, cos_sin: tuple, metadata: Any) -> torch.Tensor:
        num_tokens, num_heads, num_kv_heads = hidden.shape[0], self.num_heads, self.num_kv_heads
        # [num_tokens, heads + 2 * kv_heads, head_dim]: q, k and v heads side by side
        qkv = self.qkv_proj(hidden).view(num_tokens, num_heads + 2 * num_kv_heads,
                                         self.head_dim)
        v = qkv[:, num_heads + num_kv_heads :]
        if self.q_norm is None:  # rotate q and k heads in one pass
            qk = apply_rotary(qkv[:, : num_heads + num_kv_heads], *cos_sin)
            q, k = qk[:, :num_heads], qk[:, num_heads:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, :num_heads]), *cos_sin)
            k = apply_rotary(self.k_norm(qkv[:, num_heads : num_heads + num_kv_heads]), *cos_sin)
        return self.o_proj(self.attn(q, k, v, metadata))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, parallel: ParallelContext,
                 intermediate_size: int | None = None):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size] * 2, bias, dtype,
                                                       parallel)
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias, dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


@dataclass(frozen=True)
class DecoderLayerParts:
    """What a decoder layer is made of, for a step that runs it whole in another form
    (executor/fused_cpu_layers.py): norm -> attention -> norm -> a dense gated MLP (`gate_up`,
    `down`), or another MLP (`mlp`: MoE experts), which that step leaves to torch."""

    input_norm: RMSNorm
    attention: LlamaAttention
    post_norm: RMSNorm
    gate_up: MergedColumnParallelLinear | None
    down: RowParallelLinear | None
    mlp: nn.Module | None = None  # where gate_up and down are None


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, backend: AttentionBackend,
                 parallel: ParallelContext, mlp: nn.Module, **attn_flags):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, dtype, backend, parallel, **attn_flags)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = mlp

    def forward(self, hidden, residual, cos_sin, metadata):
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def parts(self) -> DecoderLayerParts:
        if not isinstance(self.mlp, LlamaMLP):  # MoE experts: routed in torch
            return DecoderLayerParts(self.input_layernorm, self.self_attn,
                                     self.post_attention_layernorm, None, None, self.mlp)
        return DecoderLayerParts(self.input_layernorm, self.self_attn,
                                 self.post_attention_layernorm, self.mlp.gate_up_proj,
                                 self.mlp.down_proj)


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (our fused parameter, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    attn_flags: dict[str, bool] | None = None  # None: read attention_bias from the config
    # A whole-stack step the executor installs when it binds the KV cache (the fused CPU
    # layers); `can_run(hidden, metadata)` says whether it takes this step.
    fused_layers: Callable | None = None

    def __init__(self, cfg: Any, dtype: torch.dtype, backend: AttentionBackend,
                 max_position: int, parallel: ParallelContext):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        flags = self.attn_flags or {
            "qkv_bias": bool(getattr(cfg, "attention_bias", False)),
            "o_bias": bool(getattr(cfg, "attention_bias", False)),
            "qk_norm": False,
        }
        self.sliding_window = self._sliding_window(cfg, max_position)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # A pipeline stage builds only its own layers; the first holds the embedding, the last
        # the final norm and LM head (with its own copy of a tied embedding).
        shard = parallel.shard
        self.first_layer, self.end_layer = shard.layers or (0, cfg.num_hidden_layers)
        self.has_embedding, self.is_last_stage = shard.has_embedding, shard.has_lm_head
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype,
                                                    parallel) if self.has_embedding else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, dtype, backend, parallel,
                              self.make_mlp(cfg, index, dtype, parallel), **flags)
            for index in range(self.first_layer, self.end_layer)
        )
        self.rotary_emb = RotaryEmbedding(head_dim, max_position, rope_parameters(cfg))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.norm = self.lm_head = None
        if self.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, parallel)
            if self.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.tie_to(self.embed_tokens)

    def make_mlp(self, cfg: Any, layer_index: int, dtype: torch.dtype,
                 parallel: ParallelContext) -> nn.Module:
        """The feed-forward block of decoder layer `layer_index` (MoE models: experts)."""
        return LlamaMLP(cfg, dtype, parallel)

    @staticmethod
    def _sliding_window(cfg: Any, max_position: int) -> int | None:
        window = getattr(cfg, "sliding_window", None)
        return window if window and window < max_position else None

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: Any,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """[num_tokens] token ids and positions -> [num_tokens, hidden] final hidden states.
        A pipeline stage after the first starts from the previous stage's `intermediate`
        (hidden, residual); a stage before the last returns its (hidden, residual)."""
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        cos_sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        fused = self.fused_layers
        if fused is not None and fused.can_run(hidden, metadata):
            hidden, residual = fused(hidden, residual, cos_sin, metadata)
        else:
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, cos_sin, metadata)
        if not self.is_last_stage:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each attention layer's slice of the paged KV cache."""
        for layer, kv in zip(self.attention_layers, kv_caches, strict=True):
            layer.kv_cache = kv

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.compute_logits(hidden)

    def _local_name(self, name: str) -> str | None:
        """Where checkpoint tensor `name` goes in this stage (None: another stage's)."""
        if name.startswith("layers."):
            index, rest = name.removeprefix("layers.").split(".", 1)
            if not self.first_layer <= int(index) < self.end_layer:
                return None
            return f"layers.{int(index) - self.first_layer}.{rest}"
        if name == "embed_tokens.weight" and self.embed_tokens is None:
            # The last stage's copy of a tied embedding.
            return "lm_head.weight" if self.is_last_stage and self.tie_word_embeddings else None
        if name == "lm_head.weight" and (self.tie_word_embeddings or not self.is_last_stage):
            return None
        if name.startswith("norm.") and not self.is_last_stage:
            return None
        return name

    def _load_expert(self, name: str, source: WeightSource) -> set[str]:
        """`layers.{i}.mlp.experts.{e}.{projection}.weight` -> our fused parameter of layer i,
        if this rank holds expert e; returns the names of what it filled."""
        prefix, rest = name.split(".experts.", 1)
        expert, projection, _ = rest.split(".")
        experts = self.get_submodule(f"{prefix}.experts")
        if not experts.holds(int(expert)):
            return set()
        return {f"{prefix}.experts.{experts.load_expert(int(expert), projection, source)}"}

    def load_weights(self, weights: Iterable[WeightSource]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for source in weights:
            if "rotary_emb.inv_freq" in source.name:
                continue
            name = self._local_name(source.name.removeprefix("model."))
            if name is None:
                continue
            if ".experts." in name:  # MoE: one expert's projection, kept only where it lives
                loaded.update(self._load_expert(name, source))
                continue
            shard_id = None
            for ckpt_name, (fused, shard) in self.packed_modules.items():
                if f".{ckpt_name}." in name:
                    name, shard_id = name.replace(ckpt_name, fused), shard
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {source.name!r} has no place in "
                                 f"{type(self).__name__}")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            if shard_id is not None:
                loader(param, source, shard_id)
            elif loader is not None:
                loader(param, source)
            else:
                param.data.copy_(source.expect(*param.shape).load())
            loaded.add(name)
        tied_head = self.tie_word_embeddings and self.embed_tokens is not None
        expected = {n for n in params if not (n == "lm_head.weight" and tied_head)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

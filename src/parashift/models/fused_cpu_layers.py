"""A Llama-family model's decoder layers as one call each into the CPU kernels
(kernels/cpu/layer.cpp), where every piece of a layer runs on them anyway: bfloat16 weights on
our own GEMM path (layers/gemm_paths.py "own-bf16") or int8 weights on our int8 GEMM
(`--quantization int8`), bf16 activations, bf16 decode attention in vector lanes
(AVX512-BF16 or AVX2), one
tensor-parallel rank, no q/k norm, no row-parallel bias, a dense MLP. The same kernels in the
same order on the same inputs give the same bits as the layers called one by one; what goes is
the Python between them (about a tenth of a decode step at batch 32 on a Zen 5).

Layer by layer still: steps past a weight's row limit (big prefills, where F.linear takes
over), steps with prefills where the attention backend leaves prefill tokens to SDPA (without
AVX512-BF16), and steps under torch.profiler (`bench latency --breakdown` splits the ops)."""

from __future__ import annotations

import itertools
import sys
from typing import Any

import torch
from torch import nn

from parashift.layers.attention.cpu_backend import CpuAttentionBackend
from parashift.layers.gemm_paths import OwnBf16Weight
from parashift.layers.kernel_dispatch import cpu_ops
from parashift.layers.quantization import QuantizedWeight

OwnWeight = OwnBf16Weight | QuantizedWeight


def _own(linear: nn.Module) -> OwnWeight | None:
    """The linear's weight where one of our GEMMs takes it (bf16, or int8 on our kernel)."""
    packed = getattr(linear, "packed_weight", None)
    if isinstance(packed, OwnBf16Weight) or (isinstance(packed, QuantizedWeight)
                                             and packed.own_kernel):
        return packed
    return None


def _packed(w: OwnWeight) -> torch.Tensor:
    return w.packed if isinstance(w, OwnBf16Weight) else w.qweight


def _scale(w: OwnWeight) -> torch.Tensor | None:
    return w.scales if isinstance(w, QuantizedWeight) else None


def _max_rows(w: OwnWeight) -> int:
    """Past it F.linear takes a bf16 GEMM; int8 weights have no float weight to give it."""
    return w.max_rows if isinstance(w, OwnBf16Weight) else sys.maxsize


def _fusable(layer: nn.Module) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, getattr(mlp, "gate_up_proj", None),
               getattr(mlp, "down_proj", None))
    return (all(m is not None and _own(m) is not None for m in linears)
            and len({type(_own(m)) for m in linears}) == 1
            and attn.q_norm is None and attn.qkv_proj.tp_size == 1
            and attn.o_proj.bias is None and mlp.down_proj.bias is None
            and isinstance(attn.attn.backend, CpuAttentionBackend)
            and attn.head_dim in (64, 128) and attn.attn.kv_cache is not None
            and layer.input_layernorm.weight.dtype == torch.bfloat16
            and layer.input_layernorm.eps == layer.post_attention_layernorm.eps)


class FusedCpuLayers:
    """The layers of one model (`for_model`), bound to its packed weights and KV cache: raw
    pointers, so made again whenever either is (LlamaForCausalLM.bind_kv_cache)."""

    def __init__(self, layers: nn.ModuleList, ops):
        from parashift.kernels.cpu.library import LayerWeights

        self.ops = ops
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.intermediate = mlp.down_proj.weight.shape[1]
        self.eps, self.scale = first.input_layernorm.eps, attn.attn.scale
        self.block_size = attn.attn.kv_cache[0].shape[1]
        self.max_rows = min(_max_rows(_own(m)) for layer in layers
                            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                      layer.mlp.gate_up_proj, layer.mlp.down_proj))
        self.weights = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            key_cache, value_cache = attn.attn.kv_cache
            qkv, o, gate_up, down = (_own(m) for m in (attn.qkv_proj, attn.o_proj,
                                                       mlp.gate_up_proj, mlp.down_proj))
            self.weights.append(LayerWeights.of(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                _packed(qkv), attn.qkv_proj.bias, _packed(o), _packed(gate_up),
                mlp.gate_up_proj.bias, _packed(down), key_cache, value_cache, None,
                _scale(qkv), _scale(o), _scale(gate_up), _scale(down)))
        for layer, following in itertools.pairwise(self.weights):
            if bool(layer.qkv_scale) == bool(following.qkv_scale):  # of the same kind
                layer.next_qkv = following.qkv  # fetched while the layer's last GEMM ends

    @classmethod
    def for_model(cls, layers: nn.ModuleList) -> FusedCpuLayers | None:
        from parashift.models.llama import LlamaDecoderLayer, LlamaMLP

        ops = cpu_ops()
        if ops is None or not ops.bf16_attention or len(layers) == 0:
            return None
        if not all(isinstance(layer, LlamaDecoderLayer) and isinstance(layer.mlp, LlamaMLP)
                   and _fusable(layer) for layer in layers):
            return None
        return cls(layers, ops)

    def can_run(self, hidden: torch.Tensor, metadata: Any) -> bool:
        tokens = hidden.shape[0]
        return (0 < tokens <= self.max_rows and hidden.dtype == torch.bfloat16
                and hidden.is_cpu and not torch.autograd._profiler_enabled()
                and (not metadata.prefills
                     or getattr(metadata, "prefill_tokens", None) is not None))

    @staticmethod
    def _token_tables(metadata: Any, tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Every token's block table and length, decodes first (one query over the cache each),
        then each prefill token over its own prefix; and the sliding window (0: none)."""
        parts = [p for p in (metadata.decodes if metadata.num_decodes else None,
                             getattr(metadata, "prefill_tokens", None)) if p is not None]
        window = parts[0].window or 0
        if len(parts) == 1:
            return parts[0].block_tables, parts[0].seq_lens, window
        width = max(p.block_tables.shape[1] for p in parts)
        tables = torch.zeros((tokens, width), dtype=torch.int32)
        row = 0
        for p in parts:
            rows, cols = p.block_tables.shape
            tables[row : row + rows, :cols] = p.block_tables
            row += rows
        return tables, torch.cat([p.seq_lens for p in parts]), window

    def __call__(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                 cos_sin: tuple[torch.Tensor, torch.Tensor], metadata: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        from parashift.kernels.cpu.library import LayerStep

        tokens, h = hidden.shape
        qkv_width = (self.heads + 2 * self.kv_heads) * self.head_dim
        widths = (h, qkv_width, self.heads * self.head_dim, h, 2 * self.intermediate,
                  self.intermediate)
        scratch = torch.empty(tokens * sum(widths), dtype=torch.bfloat16)
        buffers, offset = [], 0
        for width in widths:
            buffers.append(scratch[offset : offset + tokens * width].data_ptr())
            offset += tokens * width
        tables, lens, window = self._token_tables(metadata, tokens)
        cos, sin = cos_sin
        hidden = hidden.contiguous()
        first = residual is None
        residual = torch.empty_like(hidden) if first else residual.contiguous()
        step = LayerStep(tokens, h, self.heads, self.kv_heads, self.head_dim, self.intermediate,
                         self.eps, self.scale, cos.data_ptr(), sin.data_ptr(),
                         metadata.slot_mapping.data_ptr(), tables.data_ptr(), tables.shape[1],
                         lens.data_ptr(), self.block_size, window, *buffers,
                         torch.get_num_threads())
        chunks = getattr(metadata, "prefill_chunks", None)
        if chunks is not None:  # the tiled prefill kernel, as the layers call it one by one
            step.decodes, step.prefills = metadata.num_decodes, chunks.seq_lens.shape[0]
            step.chunk_tables, step.chunk_table_width = (chunks.block_tables.data_ptr(),
                                                         chunks.block_tables.shape[1])
            step.query_starts = chunks.query_starts.data_ptr()
            step.chunk_seq_lens = chunks.seq_lens.data_ptr()
        for i, weights in enumerate(self.weights):
            self.ops.llama_layer_bf16(weights, step, hidden, residual, first and i == 0)
        return hidden, residual

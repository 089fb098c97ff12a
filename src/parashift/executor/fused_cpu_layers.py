"""A model's decoder layers as one call each into the CPU kernels (kernels/cpu/layer.cpp),
installed by the model runner on any model whose layers describe themselves as norm ->
attention -> norm -> MLP (`parts()`, models/llama.py: the Llama, Qwen2, Qwen3, Mistral,
Mixtral and Qwen-MoE families), where every piece of a layer runs on the kernels anyway:
bfloat16 weights on our own GEMM path (layers/gemm_paths.py "own-bf16") or int8 weights on our
int8 GEMM (`--quantization int8`), bf16 activations, bf16 decode attention in vector lanes
(AVX512-BF16 or AVX2), one tensor-parallel rank, no q/k norm, no row-parallel bias. A dense
gated MLP runs in the same call; an MoE layer's call stops at its post-attention norm and its
experts run in torch (routing, expert dispatch under ep) before the next call. The same
kernels in the same order on the same inputs give the same bits as the layers called one by
one; what goes is the Python between them (about a tenth of a decode step at batch 32 on a
Zen 5).

Layer by layer still: steps with prefills where the attention backend leaves prefill tokens
to SDPA (without AVX512-BF16), steps under torch.profiler (`bench latency --breakdown` splits
the ops), and models with q/k norms (Qwen3, Qwen3-MoE) or tensor parallel attention."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from parashift.layers.attention.cpu_backend import CpuAttentionBackend
from parashift.layers.gemm import OwnBf16Gemm
from parashift.layers.kernel_dispatch import cpu_ops
from parashift.layers.quantization import QuantizedGemm
from parashift.models.llama import DecoderLayerParts

OwnGemm = OwnBf16Gemm | QuantizedGemm


def _own(linear: nn.Module) -> OwnGemm | None:
    """The linear's GEMM where it is one of ours (bf16, or int8 on our kernel)."""
    gemm = getattr(linear, "gemm", None)
    if isinstance(gemm, OwnBf16Gemm) or (isinstance(gemm, QuantizedGemm)
                                         and gemm.quantized.own_kernel):
        return gemm
    return None


def _packed(g: OwnGemm) -> torch.Tensor:
    return g.packed if isinstance(g, OwnBf16Gemm) else g.quantized.qweight


def _scale(g: OwnGemm) -> torch.Tensor | None:
    return g.quantized.scales if isinstance(g, QuantizedGemm) else None


def _projections(parts: DecoderLayerParts) -> tuple[nn.Module, ...]:
    attn = parts.attention
    dense = (parts.gate_up, parts.down) if parts.mlp is None else ()
    return (attn.qkv_proj, attn.o_proj, *dense)


def _fusable(parts: DecoderLayerParts | None) -> bool:
    if parts is None:
        return False
    attn = parts.attention
    linears = _projections(parts)
    return (all(_own(m) is not None for m in linears)
            and len({type(_own(m)) for m in linears}) == 1
            and attn.q_norm is None and attn.qkv_proj.tp_size == 1
            and attn.o_proj.bias is None and (parts.down is None or parts.down.bias is None)
            and isinstance(attn.attn.backend, CpuAttentionBackend)
            and attn.head_dim in (64, 128) and attn.attn.kv_cache is not None
            and parts.input_norm.weight.dtype == torch.bfloat16
            and parts.input_norm.eps == parts.post_norm.eps)


class FusedCpuLayers:
    """The layers of one model (`for_model`), bound to its packed weights and KV cache: raw
    pointers, so made again whenever either is (ModelRunner.bind_kv_cache)."""

    def __init__(self, layers: list[DecoderLayerParts], ops):
        from parashift.kernels.cpu.layer_structs import LayerWeights

        self.ops = ops
        attn = layers[0].attention
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        # the dense MLPs' width (MoE layers have none: 0 where no layer is dense)
        self.intermediate = next((p.down.weight.shape[1] for p in layers if p.down is not None),
                                 0)
        self.mlps = [p.mlp for p in layers]  # an MoE layer's experts, run in torch
        self.eps, self.scale = layers[0].input_norm.eps, attn.attn.scale
        self.decode_order = attn.attn.backend.deterministic  # prefill attends as decode does
        self.block_size = attn.attn.kv_cache[0].shape[1]
        self.weights = []
        for p in layers:
            attn = p.attention
            key_cache, value_cache = attn.attn.kv_cache
            qkv, o = _own(attn.qkv_proj), _own(attn.o_proj)
            gate_up, down = (None, None) if p.mlp is not None else (_own(p.gate_up),
                                                                    _own(p.down))
            self.weights.append(LayerWeights.of(
                p.input_norm.weight, p.post_norm.weight, _packed(qkv), attn.qkv_proj.bias,
                _packed(o), gate_up and _packed(gate_up), p.gate_up and p.gate_up.bias,
                down and _packed(down), key_cache, value_cache, None, _scale(qkv), _scale(o),
                gate_up and _scale(gate_up), down and _scale(down)))
        for layer, following in itertools.pairwise(self.weights):
            if bool(layer.qkv_scale) == bool(following.qkv_scale):  # of the same kind
                layer.next_qkv = following.qkv  # fetched while the layer's last GEMM ends

    @classmethod
    def for_model(cls, model: nn.Module) -> FusedCpuLayers | None:
        """The fused layers of `model`, or None where any layer cannot run fused here."""
        ops = cpu_ops()
        layers = [layer.parts() if hasattr(layer, "parts") else None
                  for layer in getattr(model, "layers", ())]
        if ops is None or not ops.bf16_attention or not layers or not all(map(_fusable, layers)):
            return None
        return cls(layers, ops)

    def can_run(self, hidden: torch.Tensor, metadata: Any) -> bool:
        tokens = hidden.shape[0]
        return (0 < tokens and hidden.dtype == torch.bfloat16
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
        from parashift.kernels.cpu.layer_structs import LayerStep

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
            step.decode_order = self.decode_order
        for i, (weights, mlp) in enumerate(zip(self.weights, self.mlps, strict=True)):
            self.ops.llama_layer_bf16(weights, step, hidden, residual, first and i == 0)
            if mlp is not None:  # the layer stopped at its post-attention norm
                hidden = mlp(hidden).contiguous()
        return hidden, residual

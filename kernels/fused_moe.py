"""Fused MoE: the routed experts of a layer as two grouped GEMMs over the aligned slots.

    gate_up[slot] = x[slot // top_k] @ w13[expert]^T          (one tile: one expert)
    out[slot]     = topk_weight[slot] * silu_and_mul(gate_up[slot]) @ w2[expert]^T
    y[token]      = sum over its top_k slots of out[slot]

w13 [E, 2I, hidden] (gate rows, then up rows), w2 [E, hidden, I]. Slots routed to an expert
outside [0, E) (another rank's) are computed nowhere and add zero."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .decode_attention import dot_precision
from .moe_align import AlignedSlots, align_slots


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_slots, a_stride, b_stride_e, b_stride_n, c_stride,
    ROWS_PER_A: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    if tile_m * BLOCK_M < tl.load(num_padded_ptr):
        expert = tl.load(expert_ids_ptr + tile_m).to(tl.int64)
        slots = tl.load(sorted_ids_ptr + tile_m * BLOCK_M + tl.arange(0, BLOCK_M))
        live = slots < num_slots
        a_rows = (slots // ROWS_PER_A).to(tl.int64)
        n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            a = tl.load(a_ptr + a_rows[:, None] * a_stride + kk[None, :],
                        mask=live[:, None] & (kk < K)[None, :], other=0.0)
            b = tl.load(b_ptr + expert * b_stride_e + n[None, :] * b_stride_n + kk[:, None],
                        mask=(n < N)[None, :] & (kk < K)[:, None], other=0.0)  # [BK, BN]
            acc += tl.dot(a, b, input_precision=PRECISION)
        if MUL_WEIGHT:
            acc *= tl.load(topk_weights_ptr + slots, mask=live, other=0.0)[:, None]
        tl.store(c_ptr + slots.to(tl.int64)[:, None] * c_stride + n[None, :],
                 acc.to(c_ptr.dtype.element_ty), mask=live[:, None] & (n < N)[None, :])


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, aligned: AlignedSlots,
                  rows_per_a: int, topk_weights: torch.Tensor | None) -> None:
    """c[slot] = a[slot // rows_per_a] @ b[expert]^T (times the slot's weight)."""
    num_experts, n, k = b.shape
    assert a.stride(1) == 1 and b.is_contiguous() and c.stride(1) == 1
    block_n, block_k = 64, 32
    grid = (aligned.expert_ids.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, topk_weights if topk_weights is not None else c, aligned.sorted_ids,
        aligned.expert_ids, aligned.num_padded, n, k, c.shape[0], a.stride(0), b.stride(0),
        b.stride(1), c.stride(0), ROWS_PER_A=rows_per_a, MUL_WEIGHT=topk_weights is not None,
        BLOCK_M=aligned.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(a.dtype))


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden [num_tokens, hidden]; topk_weights [num_tokens, top_k] (float32), topk_ids
    [num_tokens, top_k] local expert ids. Returns [num_tokens, hidden]."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, _ = w13.shape
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(hidden)
    block_m = 16 if num_slots <= 16 * num_experts else 64
    aligned = align_slots(topk_ids, num_experts, block_m)
    gate_up = torch.empty(num_slots, two_i, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, gate_up, aligned, top_k, None)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up  # rows of slots not held here are never read
    out = torch.zeros(num_slots, w2.shape[1], dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(act, w2, out, aligned, 1, topk_weights.reshape(-1).float().contiguous())
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids):
    """Expert by expert, in float32."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(w13.shape[0]):
        token, choice = (topk_ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = (hidden[token].float() @ w13[expert].float().t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[expert].float().t()
        out.index_add_(0, token, y * topk_weights[token, choice, None].float())
    return out.to(hidden.dtype)

"""Rotary position embedding, neox layout (the two halves of each head rotate together),
applied in place to the query and key heads of every token.

The cos/sin tables [max_position, head_dim // 2] are built by the layer, so any frequency
scaling (linear, llama3) is already in them; without `positions` they are the step's own
tables, one row per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, num_heads, cos, sin, d, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & (d < HALF)[None, :]
    ptr = x_ptr + token * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(ptr, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, positions_ptr, q_stride_t, q_stride_h,
                   k_stride_t, k_stride_h, num_q_heads, num_k_heads, HALF: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = token
    if HAS_POSITIONS:
        pos = tl.load(positions_ptr + token).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + pos * HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + d, mask=d < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, token, q_stride_t, q_stride_h, num_q_heads, cos, sin, d, HALF, BLOCK_H)
    _rotate_heads(k_ptr, token, k_stride_t, k_stride_h, num_k_heads, cos, sin, d, HALF, BLOCK_H)


def apply_rotary(q: torch.Tensor, k: torch.Tensor | None, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor, positions: torch.Tensor | None = None) -> None:
    """In place. q: [num_tokens, num_q_heads, head_dim], k: [num_tokens, num_k_heads, head_dim]
    or None (views of the qkv output are fine: the last dim must be contiguous); cos/sin rows
    are contiguous."""
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    k = q[:, :0] if k is None else k
    assert q.stride(2) == 1 and k.stride(2) == 1 and head_dim % 2 == 0
    half = head_dim // 2
    assert cos_cache.stride(-1) == 1 and cos_cache.numel() // cos_cache.shape[0] == half
    _rotary_kernel[(num_tokens,)](
        q, k, cos_cache, sin_cache, positions if positions is not None else cos_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), num_q_heads, k.shape[1],
        HALF=half, BLOCK_D=triton.next_power_of_2(half),
        BLOCK_H=triton.next_power_of_2(max(num_q_heads, k.shape[1])),
        HAS_POSITIONS=positions is not None)


def apply_rotary_reference(q, k, cos_cache, sin_cache, positions):
    """Returns the rotated (q, k), computed in float32."""
    cos = cos_cache[positions].float().unsqueeze(1)
    sin = sin_cache[positions].float().unsqueeze(1)

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)

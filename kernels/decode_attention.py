"""Paged decode attention: one query token per sequence against its cached keys and values,
read through the block table.

One program per (sequence, kv head, split): the query heads that share the kv head (GQA) are
the rows of one tile, so each key/value block is read once for its whole group. A long context
is cut into `num_splits` ranges of blocks (split-K) so that a small batch still fills the GPU;
a second pass merges the splits by their log-sum-exp. The split count is a run-time argument:
as contexts grow and batches change, the engine's split counts vary step by step, and each
compile-time value would be one more JIT compile in the middle of serving."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .online_softmax import online_softmax_step


@triton.jit
def _decode_split_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    scale, q_stride_b, q_stride_h, block_table_stride, cache_block_stride, cache_token_stride,
    sliding_window, num_heads, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, TILE_BLOCKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # the query sits at seq_len - 1 and sees the last `sliding_window` keys (0: all)
    lo = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    first_block = lo // BLOCK_SIZE
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    per_split = tl.cdiv(num_blocks - first_block, num_splits)
    start = first_block + split * per_split
    end = tl.minimum(start + per_split, num_blocks)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + d[None, :],
                mask=q_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # A tile is TILE_BLOCKS cache blocks: more bytes in flight per iteration than one block.
    t = tl.arange(0, TILE_BLOCKS * BLOCK_SIZE)
    for b0 in range(start, end, TILE_BLOCKS):
        b = b0 + t // BLOCK_SIZE
        in_range = b < end
        block = tl.load(block_tables_ptr + seq * block_table_stride + b, mask=in_range,
                        other=0).to(tl.int64)
        pos = b * BLOCK_SIZE + t % BLOCK_SIZE
        valid = in_range & (pos < seq_len) & (pos >= lo)
        offs = (block[:, None] * cache_block_stride + (t % BLOCK_SIZE)[:, None] * cache_token_stride
                + kv_head * HEAD_DIM + d[None, :])
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(key_cache_ptr + offs, mask=kv_mask, other=0.0)  # [TILE, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, TILE]
        s = tl.where(valid[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        v = tl.load(value_cache_ptr + offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    # Every block of the range holds a key the query sees, so a non-empty split has l_i > 0;
    # an empty one (a short context, or a padded row with seq_len 0) reports lse = -inf.
    has_keys = l_i > 0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    row = (seq * num_heads + heads) * num_splits + split  # [BLOCK_G]
    tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)
    tl.store(lse_ptr + row, lse, mask=g < GROUP)


@triton.jit
def _merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, out_stride_b, out_stride_h, num_heads,
                         num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_S: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (seq * num_heads + head) * num_splits + s
    lse = tl.load(lse_ptr + row, mask=s < num_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no key at all: the output is zero
    weight = tl.exp(lse - top)
    partial = tl.load(partial_ptr + row[:, None] * HEAD_DIM + d[None, :],
                      mask=(s < num_splits)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * out_stride_b + head * out_stride_h + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass(frozen=True)
class Launch:
    """How a kernel is cut: cache blocks per key tile, warps per program, and the software
    pipeline's stages (Triton's num_stages)."""
    tile_blocks: int = 1
    num_warps: int = 4
    num_stages: int = 3


def decode_launch(blocks_per_seq: int, num_splits: int) -> Launch:
    """Tiles of 4 blocks where a program walks many blocks, else 2, both with 2 pipeline
    stages: chosen with `python scripts/bench_kernels.py --sweep` on an H200 (the figures:
    docs/BENCHMARKS.md). Tiles of 4 lose where a program walks few blocks."""
    many = -(-blocks_per_seq // num_splits) >= 96
    return Launch(tile_blocks=4 if many else 2, num_warps=4, num_stages=2)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models get fp32 products (the GPU default would be TF32's 10-bit mantissa)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_size: int,
                   num_sms: int = 132) -> int:
    """Enough programs to fill the GPU about twice, never a split under 4 blocks."""
    wanted = math.ceil(2 * num_sms / max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, math.ceil(max_seq_len / (4 * block_size)), 64))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, num_splits: int = 1,
                           sliding_window: int | None = None,
                           out: torch.Tensor | None = None,
                           launch: Launch | None = None) -> torch.Tensor:
    """query: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] (keys per
    sequence, the query's own included). Returns [num_seqs, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert query.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    assert block_size >= 16, "tl.dot needs tiles of at least 16 rows"
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    launch = launch or decode_launch(block_tables.shape[1], num_splits)
    partial = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                          device=query.device)
    lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, partial, lse, scale,
        query.stride(0), query.stride(1), block_tables.stride(0), key_cache.stride(0),
        key_cache.stride(1), sliding_window or 0, num_heads, num_splits,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_SIZE=block_size, PRECISION=dot_precision(query.dtype),
        TILE_BLOCKS=launch.tile_blocks, num_warps=launch.num_warps, num_stages=launch.num_stages)
    _merge_splits_kernel[(num_seqs, num_heads)](
        partial, lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits))
    return out


def paged_decode_attention_reference(query, key_cache, value_cache, block_tables, seq_lens,
                                     scale, sliding_window=None):
    """Per sequence, in float32: gather its keys/values, softmax(q k^T * scale) v."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for i in range(num_seqs):
        n = int(seq_lens[i])
        lo = max(n - sliding_window, 0) if sliding_window else 0
        if n == 0:
            continue
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[lo:n].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[lo:n].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [n, heads, head_dim]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out.to(query.dtype)

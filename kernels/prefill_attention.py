"""Varlen prefill attention over the paged cache: each sequence's new query tokens (a whole
prompt, a chunk of one, or the tail after a prefix-cache hit) attend causally to every key
before them, the cached prefix and the new tokens alike, all read through the block table
(the new keys were written to the cache first).

One program per (sequence, query head, tile of BLOCK_M query tokens); it walks the key blocks
up to its last query's position with an online softmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .decode_attention import Launch, dot_precision
from .online_softmax import online_softmax_step


@dataclass(frozen=True)
class PrefillLaunch(Launch):
    block_m: int = 64  # query rows per program (16 when no sequence has more new tokens)


# Chosen with `python scripts/bench_kernels.py --sweep` on an H200 (docs/BENCHMARKS.md).
PREFILL_LAUNCH = PrefillLaunch(tile_blocks=4, num_warps=4, num_stages=2)


@triton.jit
def _prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    out_ptr, scale, q_stride_t, q_stride_h, out_stride_t, out_stride_h, block_table_stride,
    cache_block_stride, cache_token_stride, sliding_window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len  # tokens cached before this step
        kv_head = head // GROUP
        m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        q_pos = context + m  # [BLOCK_M]
        q_mask = (m < q_len)[:, None] & (d < HEAD_DIM)[None, :]
        tokens = (q_start + m).to(tl.int64)
        q = tl.load(q_ptr + tokens[:, None] * q_stride_t + head * q_stride_h + d[None, :],
                    mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
        last = tl.minimum(context + (tile + 1) * BLOCK_M, seq_len)  # keys [lo, last)
        lo = tl.where(sliding_window > 0,
                      tl.maximum(context + tile * BLOCK_M - sliding_window + 1, 0), 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        t = tl.arange(0, TILE_BLOCKS * BLOCK_SIZE)  # a key tile of TILE_BLOCKS cache blocks
        end = tl.cdiv(last, BLOCK_SIZE)
        for b0 in range(lo // BLOCK_SIZE, end, TILE_BLOCKS):
            b = b0 + t // BLOCK_SIZE
            block = tl.load(block_tables_ptr + seq * block_table_stride + b, mask=b < end,
                            other=0).to(tl.int64)
            k_pos = b * BLOCK_SIZE + t % BLOCK_SIZE
            offs = (block[:, None] * cache_block_stride
                    + (t % BLOCK_SIZE)[:, None] * cache_token_stride
                    + kv_head * HEAD_DIM + d[None, :])
            kv_mask = ((b < end) & (k_pos < seq_len))[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(key_cache_ptr + offs, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, TILE]
            seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos < seq_len)[None, :]
            if sliding_window > 0:
                seen = seen & (k_pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(seen, s, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
            v = tl.load(value_cache_ptr + offs, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            max_query_len: int, scale: float,
                            sliding_window: int | None = None,
                            out: torch.Tensor | None = None,
                            launch: PrefillLaunch = PREFILL_LAUNCH) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim], the sequences' new tokens back to back;
    query_start_loc: [num_seqs + 1] offsets into it; seq_lens: [num_seqs] context after this
    step (cached prefix + new tokens); caches as for decode. Returns like query."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert query.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    assert block_size >= 16, "tl.dot needs tiles of at least 16 rows"
    out = torch.empty_like(query) if out is None else out
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = 16 if max_query_len <= 16 else launch.block_m
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        key_cache.stride(0), key_cache.stride(1), sliding_window or 0,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, PRECISION=dot_precision(query.dtype), TILE_BLOCKS=launch.tile_blocks,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out


def paged_prefill_attention_reference(query, key_cache, value_cache, block_tables,
                                      query_start_loc, seq_lens, scale, sliding_window=None):
    """Per sequence, in float32, with an explicit causal (and window) mask."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    for i in range(seq_lens.shape[0]):
        start, end, n = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q_pos = torch.arange(n - (end - start), n, device=query.device)[:, None]
        k_pos = torch.arange(n, device=query.device)[None, :]
        seen = k_pos <= q_pos
        if sliding_window:
            seen &= k_pos > q_pos - sliding_window
        scores = torch.einsum("qhd,nhd->hqn", query[start:end].float(), k) * scale
        scores = scores.masked_fill(~seen, float("-inf"))
        out[start:end] = torch.einsum("hqn,nhd->qhd", scores.softmax(-1), v)
    return out.to(query.dtype)

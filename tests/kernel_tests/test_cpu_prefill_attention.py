"""The tiled prefill attention kernel (kernels/cpu/prefill_attention.cpp: AMX tiles, or
vdpbf16ps register blocks without them) against a float64
causal softmax over the same paged cache: chunks after a cached prefix, lengths around its
16-token blocks and 32-key tiles, keys scattered over the cache's blocks; and where it is not
taken (it writes nothing then). On vdpbf16ps (without AMX, or with --deterministic's
decode_order) it must give each token the decode kernel's bits exactly, however the prompt is
cut into chunks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kernel_tests.builds import load_for

BLOCK_SIZE, HEADS, KV_HEADS, HEAD_DIM = 16, 6, 2, 64


@pytest.fixture(scope="module", params=["native", "cooperlake"])  # AMX where it is; not
def ops(request, tmp_path_factory):
    ops = load_for(request.param, tmp_path_factory)
    if not ops.bf16_dot:
        pytest.skip("this CPU has no AVX512-BF16")
    return ops


def _case(chunks: list[tuple[int, int]], head_dim: int = HEAD_DIM, seed: int = 0):
    """(cached tokens, chunk tokens) per sequence -> the kernel's inputs, blocks shuffled."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-(c + q) // BLOCK_SIZE) for c, q in chunks]
    blocks = sum(per_seq) + 3
    key_cache = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, head_dim, generator=g).bfloat16()
    value_cache = torch.randn(blocks, BLOCK_SIZE, KV_HEADS, head_dim, generator=g).bfloat16()
    order = torch.randperm(blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(chunks), max(per_seq), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used:used + n]
        used += n
    tokens = sum(q for _, q in chunks)
    # query rows strided, as the model passes the q slice of its fused QKV projection
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, head_dim, generator=g).bfloat16()
    starts = torch.tensor(np.cumsum([0] + [q for _, q in chunks]), dtype=torch.int32)
    lens = torch.tensor([c + q for c, q in chunks], dtype=torch.int32)
    return qkv[:, :HEADS], key_cache, value_cache, tables, starts, lens


def _reference(query, key_cache, value_cache, tables, starts, lens, scale):
    out = torch.empty(query.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for i in range(len(lens)):
        n, q0, q1 = int(lens[i]), int(starts[i]), int(starts[i + 1])
        slots = [int(tables[i, j // BLOCK_SIZE]) * BLOCK_SIZE + j % BLOCK_SIZE for j in range(n)]
        k = key_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        v = value_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        q = query[q0:q1].double()  # [t, heads, d]
        scores = torch.einsum("thd,khd->htk", q, k) * scale
        pos = torch.arange(n - (q1 - q0), n)[:, None]
        scores = scores.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        out[q0:q1] = torch.einsum("htk,khd->thd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("chunks", [
    [(0, 1)], [(0, 16)], [(0, 17)], [(0, 33)],
    [(5, 16), (100, 1), (0, 37)],  # after a cached prefix; a single decode-like token
    [(17, 33), (0, 256), (31, 2)],
])
def test_causal_chunks_match_a_float64_softmax(ops, chunks):
    query, key_cache, value_cache, tables, starts, lens = _case(chunks)
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    assert ops.prefill_attention(out, query, key_cache, value_cache, tables, starts, lens, 0.125)
    want = _reference(query, key_cache, value_cache, tables, starts, lens, 0.125)
    # weights rounded to bf16 as torch's bf16 attention rounds them, the result once
    torch.testing.assert_close(out.double(), want, rtol=2 ** -7, atol=0.02)


def test_another_head_dim_is_not_taken_and_nothing_is_written(ops):
    query, key_cache, value_cache, tables, starts, lens = _case([(0, 20)], head_dim=128)
    out = torch.zeros(query.shape, dtype=torch.bfloat16)
    assert not ops.prefill_attention(out, query, key_cache, value_cache, tables, starts, lens,
                                     0.1)
    assert not out.any()


def _decode_each_token(ops, query, key_cache, value_cache, tables, starts, lens, scale):
    """Every chunk token as a decode query over its own prefix, by the decode kernel."""
    q_lens = (starts[1:] - starts[:-1]).tolist()
    token_tables = torch.cat([tables[i:i + 1].repeat(q, 1) for i, q in enumerate(q_lens)])
    token_lens = torch.cat([torch.arange(int(n) - q + 1, int(n) + 1, dtype=torch.int32)
                            for n, q in zip(lens.tolist(), q_lens, strict=True)])
    out = torch.empty(query.shape, dtype=torch.bfloat16)
    ops.paged_decode_attention(out, query, key_cache, value_cache, token_tables.contiguous(),
                               token_lens, None, scale)
    return out


@pytest.mark.parametrize("chunks", [
    [(0, 1)], [(0, 16)], [(0, 33)],
    [(5, 16), (100, 1), (0, 37)],
    [(17, 33), (0, 300), (31, 2)],
])
@pytest.mark.parametrize("spread", [1.0, 6.0])  # 6: scores far apart, weights near zero
def test_in_decode_order_each_token_gets_the_decode_kernels_bits(ops, chunks, spread):
    query, key_cache, value_cache, tables, starts, lens = _case(chunks, seed=len(chunks))
    query, key_cache = query * spread, key_cache * spread
    out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
    assert ops.prefill_attention(out, query, key_cache, value_cache, tables, starts, lens,
                                 0.125, decode_order=True)
    want = _decode_each_token(ops, query, key_cache, value_cache, tables, starts, lens, 0.125)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    if not ops.amx:  # without AMX tiles the default order is this one
        assert ops.prefill_attention(out, query, key_cache, value_cache, tables, starts, lens,
                                     0.125)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_in_decode_order_a_prompt_cut_anywhere_gets_the_same_bits(ops):
    query, key_cache, value_cache, tables, _, _ = _case([(0, 200)], seed=3)
    whole = torch.empty(query.shape, dtype=torch.bfloat16)
    assert ops.prefill_attention(whole, query, key_cache, value_cache, tables,
                                 torch.tensor([0, 200], dtype=torch.int32),
                                 torch.tensor([200], dtype=torch.int32), 0.125, decode_order=True)
    for cuts in ([0, 7, 200], [0, 64, 65, 130, 200], [0, 199, 200]):
        pieces = torch.empty(query.shape, dtype=torch.bfloat16)
        for lo, hi in itertools.pairwise(cuts):  # each piece after the ones before it, cached
            assert ops.prefill_attention(pieces[lo:hi], query[lo:hi], key_cache, value_cache,
                                         tables, torch.tensor([0, hi - lo], dtype=torch.int32),
                                         torch.tensor([hi], dtype=torch.int32), 0.125,
                                         decode_order=True)
        assert torch.equal(pieces.view(torch.int16), whole.view(torch.int16)), cuts

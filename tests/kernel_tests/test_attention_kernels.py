"""Paged attention and the KV-cache write against their torch references, over random shapes:
block sizes 16 and 32, GQA ratios 1, 3 and 8, ragged lengths (1, and not a multiple of the
block size), prefix hits, sliding windows and split-K. fp32 and fp16 (the interpreter gets
bf16 tl.dot wrong). Bounds: max |error| 2e-5 in fp32, 2e-3 in fp16 (outputs are O(1))."""

import random

import pytest
import torch
from parashift.kernels.decode_attention import (
    Launch,
    decode_launch,
    num_splits_for,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from parashift.kernels.kv_cache_write import write_kv_cache, write_kv_cache_reference
from parashift.kernels.prefill_attention import (
    PrefillLaunch,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

from kernel_tests.conftest import DEVICE

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}
HEAD_DIM = 32


def paged_cache(rng: random.Random, seq_lens: list[int], block_size: int, num_kv_heads: int,
                dtype: torch.dtype):
    """Caches filled with random K/V, and block tables that scatter each sequence's blocks."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    table = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    at = 0
    for i, count in enumerate(blocks_per_seq):
        table[i, :count] = torch.tensor(ids[at : at + count])
        at += count
    shape = (num_blocks, block_size, num_kv_heads, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    value_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    return key_cache, value_cache, table.to(DEVICE)


def lengths(rng: random.Random, count: int, block_size: int) -> list[int]:
    fixed = [1, block_size, block_size + 3, 3 * block_size - 1]
    return (fixed + [rng.randrange(1, 5 * block_size) for _ in range(count)])[:count]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size,group,num_splits,window,tile_blocks", [
    (16, 1, 1, None, 1), (32, 3, 1, None, 4), (16, 8, 3, None, 2), (32, 1, 2, 20, 4),
    (16, 3, 1, 7, 1), (16, 3, 2, 7, 4)])
def test_paged_decode_attention(dtype, block_size, group, num_splits, window, tile_blocks):
    """Key tiles of 1 to 4 cache blocks, ending past a split's or a sequence's last block."""
    rng = random.Random(block_size * 100 + group * 10 + num_splits)
    num_kv_heads = 2
    seq_lens = lengths(rng, 5, block_size)
    key_cache, value_cache, table = paged_cache(rng, seq_lens, block_size, num_kv_heads, dtype)
    query = torch.randn(len(seq_lens), num_kv_heads * group, HEAD_DIM, dtype=dtype,
                        device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM ** -0.5
    got = paged_decode_attention(query, key_cache, value_cache, table, lens, scale,
                                 num_splits, window, launch=Launch(tile_blocks=tile_blocks))
    want = paged_decode_attention_reference(query.cpu(), key_cache.cpu(), value_cache.cpu(),
                                            table.cpu(), lens.cpu(), scale, window)
    assert (got.cpu().float() - want.float()).abs().max() < TOLERANCE[dtype]


def test_a_padded_decode_row_attends_to_nothing():
    """A CUDA graph's padding rows have seq_len 0: zeros, no NaN, other rows unharmed."""
    rng = random.Random(0)
    key_cache, value_cache, table = paged_cache(rng, [20, 1], 16, 1, torch.float32)
    query = torch.randn(2, 2, HEAD_DIM, device=DEVICE)
    lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    got = paged_decode_attention(query, key_cache, value_cache, table, lens, 0.2, 2)
    want = paged_decode_attention_reference(query.cpu(), key_cache.cpu(), value_cache.cpu(),
                                            table.cpu(), lens.cpu(), 0.2)
    assert torch.equal(got[1].cpu(), torch.zeros(2, HEAD_DIM))
    assert (got[0].cpu() - want[0]).abs().max() < 2e-5


def test_splits_fill_the_gpu_only_where_the_context_is_long():
    assert num_splits_for(64, 8, 2048, 16) == 1
    assert num_splits_for(1, 2, 2048, 16) == 32
    assert num_splits_for(1, 2, 40, 16) == 1


def test_key_tiles_of_4_blocks_only_where_a_program_walks_many():
    assert decode_launch(128, 1).tile_blocks == 4  # batch 64 x 2k context: one split
    assert decode_launch(256, 33).tile_blocks == 2  # batch 1 x 4k: 8 blocks a split
    assert decode_launch(64, 1).tile_blocks == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size,group,window,tile_blocks", [
    (16, 1, None, 1), (32, 3, None, 2), (16, 8, None, 4), (16, 3, 9, 4)])
def test_paged_prefill_attention_with_cached_prefixes(dtype, block_size, group, window,
                                                      tile_blocks):
    """Whole prompts, chunks and prefix-cache hits in one batch: a sequence's query tokens are
    its last q_len positions, and everything before them is already in the cache."""
    rng = random.Random(block_size + group)
    num_kv_heads = 2
    seq_lens = [1, 17, block_size * 2, 70, 5]
    q_lens = [1, 17, 9, 70 - 2 * block_size, 5]  # whole, whole, prefix hit, chunk, whole
    key_cache, value_cache, table = paged_cache(rng, seq_lens, block_size, num_kv_heads, dtype)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), num_kv_heads * group, HEAD_DIM, dtype=dtype,
                        device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM ** -0.5
    got = paged_prefill_attention(query, key_cache, value_cache, table, starts.to(DEVICE),
                                  lens, max(q_lens), scale, window,
                                  launch=PrefillLaunch(tile_blocks=tile_blocks))
    want = paged_prefill_attention_reference(query.cpu(), key_cache.cpu(), value_cache.cpu(),
                                             table.cpu(), starts, lens.cpu(), scale, window)
    assert (got.cpu().float() - want.float()).abs().max() < TOLERANCE[dtype]


@pytest.mark.parametrize("window,launch", [(None, PrefillLaunch()), (9, PrefillLaunch()),
                                           (9, PrefillLaunch(tile_blocks=4, block_m=32))])
def test_paged_prefill_attention_over_several_query_tiles(window, launch):
    """More new tokens than one tile of 64 queries, after a cached prefix: the second tile's
    keys start where its own window does, and end at its last query."""
    rng = random.Random(11)
    seq_lens, q_lens = [100, 3], [80, 3]
    key_cache, value_cache, table = paged_cache(rng, seq_lens, 16, 1, torch.float32)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), 2, HEAD_DIM, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    got = paged_prefill_attention(query, key_cache, value_cache, table, starts.to(DEVICE),
                                  lens, max(q_lens), 0.125, window, launch=launch)
    want = paged_prefill_attention_reference(query.cpu(), key_cache.cpu(), value_cache.cpu(),
                                             table.cpu(), starts, lens.cpu(), 0.125, window)
    assert (got.cpu() - want).abs().max() < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_cache_write_through_slot_mapping(dtype):
    num_tokens, num_kv_heads = 13, 3
    # the K/V of a token are views into one qkv row, as the model produces them
    qkv = torch.randn(num_tokens, (4 + 2) * num_kv_heads, HEAD_DIM, dtype=dtype, device=DEVICE)
    key, value = qkv[:, 4 * num_kv_heads : 5 * num_kv_heads], qkv[:, 5 * num_kv_heads :]
    slots = torch.randperm(6 * 16, device=DEVICE)[:num_tokens]
    slots[3] = -1  # a padded row: written nowhere
    caches = [torch.zeros(6, 16, num_kv_heads, HEAD_DIM, dtype=dtype, device=DEVICE)
              for _ in range(4)]
    write_kv_cache(key, value, caches[0], caches[1], slots)
    write_kv_cache_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert int((caches[0] != 0).any(-1).any(-1).sum()) == num_tokens - 1

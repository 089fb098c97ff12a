"""BlockPool: reference counts, LRU order of freed blocks, cached blocks reclaimed or evicted,
the prefix cache reset, and (property test) no leaked or doubly handed-out block under random
allocate/free."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parashift.engine.kv_cache import BlockPool


def test_pool_rejects_empty():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_pool_allocate_and_free_ref_counts():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(0.5)
    pool.touch(a)  # a second owner
    assert [b.ref_cnt for b in a] == [2, 2]
    pool.free(a)
    assert pool.num_free_blocks == 2  # still owned once
    pool.free(a)
    assert pool.num_free_blocks == 4
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(a[:1])


def test_pool_hands_out_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert [b.block_id for b in pool.allocate(4)] == [2, 0, 3, 1]


def test_pool_touch_reclaims_a_free_cached_block():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.cache(block, 1234)
    pool.free([block])
    assert pool.num_free_blocks == 3
    assert pool.lookup(1234) is block  # still cached while free
    pool.touch([block])
    assert block.ref_cnt == 1 and block.block_id not in pool.free_queue
    assert pool.num_free_blocks == 2


def test_pool_eviction_forgets_the_hash():
    pool = BlockPool(1)
    (block,) = pool.allocate(1)
    pool.cache(block, 99)
    pool.free([block])
    (again,) = pool.allocate(1)  # the only block: its cached content is evicted
    assert again is block
    assert again.block_hash is None and pool.lookup(99) is None


def test_pool_cache_keeps_first_block_for_a_hash():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, 7)
    pool.cache(b, 7)  # same content computed twice: the first copy stays the cached one
    assert pool.lookup(7) is a and b.block_hash is None


def test_reset_prefix_cache_refused_while_blocks_in_use():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, 5)
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(5) is block  # nothing forgotten
    pool.free([block])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(5) is None and block.block_hash is None
    assert pool.num_free_blocks == 2


# ---------------------------------------------------------------------------------------------
# Property test


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 6),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(1, 4)), max_size=60))
def test_pool_random_allocate_free_never_leaks(num_blocks, ops):
    pool = BlockPool(num_blocks)
    held: list[list] = []
    for is_alloc, which, n in ops:
        if is_alloc and n <= pool.num_free_blocks:
            new = pool.allocate(n)
            in_use = {b.block_id for blocks in held for b in blocks}
            assert not in_use & {b.block_id for b in new}, "a block handed out twice"
            held.append(new)
        elif held:
            pool.free(held.pop(which % len(held)))
        assert pool.num_free_blocks == num_blocks - sum(len(h) for h in held)
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)

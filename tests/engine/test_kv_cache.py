"""KVCacheManager: slots rounded up to blocks, chained prefix hashes, hits on freed blocks until
they are evicted, and (property test) no leaked or doubly handed-out block under random
admit/grow/free. The BlockPool under it is tested in test_block_pool.py."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from parashift.engine.kv_cache import KVCacheManager
from parashift.engine.request import Request
from parashift.types.sampling_params import SamplingParams

BS = 4  # block size for the hand-written cases


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, SamplingParams(max_tokens=1), eos_token_id=None)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: look up its prefix, reserve the rest."""
    hits, num_hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - num_hit if num_new is None else num_new
    new_ids = kv.allocate_slots(req, num_new, hits)
    if new_ids is not None:
        kv.record_admission(req.num_tokens, num_hit)
        req.num_computed_tokens = num_hit + num_new
    return new_ids


def assert_consistent(kv: KVCacheManager) -> None:
    """Every block's ref_cnt equals its number of owners; the free queue holds exactly the
    unowned blocks; the hash table and the blocks agree."""
    pool = kv.pool
    owners = [0] * pool.num_blocks
    for blocks in kv.req_blocks.values():
        ids = [b.block_id for b in blocks]
        assert len(ids) == len(set(ids)), "a request holds the same block twice"
        for i in ids:
            owners[i] += 1
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id]
        assert (block.block_id in pool.free_queue) == (block.ref_cnt == 0)
        if block.block_hash is not None:
            assert pool.cached[block.block_hash] is block
    assert all(b.block_hash == h for h, b in pool.cached.items())
    assert pool.num_free_blocks == owners.count(0)


def test_allocate_slots_rounds_up_to_blocks_and_grows():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    req = make_request("a", list(range(5)))
    assert len(admit(kv, req)) == 2  # 5 tokens -> 2 blocks
    req.append_output_token(100)  # token 6 still fits in block 2
    assert kv.allocate_slots(req, 1) == []
    req.num_computed_tokens += 1
    for t in range(3):
        req.append_output_token(101 + t)
    assert len(kv.allocate_slots(req, 3)) == 1  # tokens 7..9: the 9th needs block 3
    req.num_computed_tokens += 3
    assert len(kv.block_ids("a")) == 3
    kv.free(req)
    assert kv.pool.num_free_blocks == 8 and kv.block_ids("a") == []


def test_allocate_slots_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=BS, enable_prefix_caching=True)
    req = make_request("a", list(range(12)))  # needs 3 blocks
    assert admit(kv, req) is None
    assert kv.pool.num_free_blocks == 2
    assert "a" not in kv.req_blocks
    assert_consistent(kv)


def test_same_prefix_hits_same_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = make_request("a", prompt)
    admit(kv, a)
    b = make_request("b", prompt + [50, 51])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 2 * BS
    assert [blk.block_id for blk in hits] == kv.block_ids("a")[:2]
    assert b.block_hashes[:2] == a.block_hashes[:2]
    kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    kv.record_admission(b.num_tokens, num_hit)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert [kv.pool.blocks[i].ref_cnt for i in kv.block_ids("a")[:2]] == [2, 2]
    assert_consistent(kv)
    assert kv.stats.hit_tokens == 2 * BS
    assert kv.stats.queried_tokens == a.num_tokens + b.num_tokens


def test_hashes_are_chained_on_the_parent():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    # Same second block, different first block: the second block must not match either.
    b = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == [] and num_hit == 0
    assert b.block_hashes[1] != a.block_hashes[1]
    assert kv.pool.lookup(b.block_hashes[1]) is None


def test_at_least_one_token_left_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(2 * BS))  # exactly two full blocks
    admit(kv, make_request("a", prompt))
    b = make_request("b", prompt)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == BS and len(hits) == 1  # the last block is recomputed for its logits
    assert b.num_tokens - num_hit >= 1


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(3 * BS))
    admit(kv, make_request("a", prompt))
    assert kv.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert kv.pool.cached == {}


def test_freed_prefix_still_hits_until_evicted_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(3 * BS + 1))  # 3 full blocks + 1 token = 4 blocks (the whole pool)
    a = make_request("a", prompt)
    admit(kv, a)
    a_ids = kv.block_ids("a")
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    # One new block: the pool evicts a's partial tail block first, then its last full one.
    other = make_request("x", [99])
    assert admit(kv, other) == [a_ids[3]]
    other2 = make_request("y", [98])
    assert admit(kv, other2) == [a_ids[2]]
    # The first two full blocks survived and still hit; the third was evicted.
    b = make_request("b", prompt)
    hits, num_hit = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == a_ids[:2] and num_hit == 2 * BS
    assert_consistent(kv)


def test_eviction_of_unreferenced_cached_blocks_when_pool_full():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(2 * BS)))
    admit(kv, a)
    kv.free(a)
    assert len(kv.pool.cached) == 2
    # A new request needing the whole pool takes a's cached blocks, evicting them.
    b = make_request("b", list(range(100, 100 + 4 * BS - 1)))
    assert admit(kv, b) is not None
    assert kv.pool.num_free_blocks == 0
    assert kv.get_computed_blocks(make_request("c", list(range(2 * BS)) + [1]))[1] == 0
    assert all(h in b.block_hashes for h in kv.pool.cached)
    assert_consistent(kv)


def test_prefix_hit_on_free_blocks_counts_them_as_taken():
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_prefix_caching=True)
    prompt = list(range(2 * BS + 1))
    a = make_request("a", prompt)
    admit(kv, a)
    kv.free(a)
    # b hits 2 free cached blocks and needs 1 more: it fits in the 3-block pool exactly.
    b = make_request("b", prompt)
    assert admit(kv, b) is not None
    assert kv.pool.num_free_blocks == 0
    assert_consistent(kv)
    # c hits the same 2 (now owned) blocks but needs 2 more blocks: refused, nothing changed.
    c = make_request("c", prompt + list(range(50, 50 + BS)))
    assert admit(kv, c) is None
    assert_consistent(kv)
    kv.free(b)
    assert kv.pool.num_free_blocks == 3


def test_blocks_filled_this_step_are_registered():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    a = make_request("a", list(range(3 * BS)))
    admit(kv, a, num_new=BS + 2)  # a chunk: one block full, one partial
    assert kv.num_cached_blocks["a"] == 1
    assert len(kv.pool.cached) == 1
    b = make_request("b", list(range(3 * BS)))
    assert kv.get_computed_blocks(b)[1] == BS


# ---------------------------------------------------------------------------------------------
# Property test


# Prompts from a tiny alphabet with a shared stem, so prefix hits are frequent.
_prompts = st.lists(st.integers(0, 1), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(1, 10),
    block_size=st.sampled_from([1, 2, 4]),
    prefix_caching=st.booleans(),
    ops=st.lists(st.tuples(st.sampled_from(["admit", "grow", "free"]), st.integers(0, 7),
                           _prompts, st.integers(1, 5)), max_size=40),
)
def test_manager_random_ops_never_leak_or_double_allocate(num_blocks, block_size,
                                                           prefix_caching, ops):
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    live: dict[str, Request] = {}
    counter = 0
    for op, which, prompt, n in ops:
        owned_before = {b.block_id: b.ref_cnt for blocks in kv.req_blocks.values()
                        for b in blocks}
        if op == "admit":
            req = make_request(f"r{counter}", prompt)
            counter += 1
            hits, num_hit = kv.get_computed_blocks(req)
            assert num_hit < req.num_tokens and num_hit % block_size == 0
            assert all(h.block_hash is not None for h in hits)
            num_new = min(n, req.num_tokens - num_hit)
            new_ids = kv.allocate_slots(req, num_new, hits)
            if new_ids is None:
                assert req.request_id not in kv.req_blocks
            else:
                req.num_computed_tokens = num_hit + num_new
                live[req.request_id] = req
        elif op == "grow" and live:
            req = list(live.values())[which % len(live)]
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token(which % 2)
            num_new = min(n, req.num_tokens - req.num_computed_tokens)
            new_ids = kv.allocate_slots(req, num_new)
            if new_ids is not None:
                req.num_computed_tokens += num_new
        elif op == "free" and live:
            req = live.pop(list(live)[which % len(live)])
            kv.free(req)
            new_ids = None
        else:
            new_ids = None
        if new_ids:
            assert not set(new_ids) & set(owned_before), "a block handed out twice"
        for req in live.values():
            assert len(kv.block_ids(req.request_id)) * block_size >= req.num_computed_tokens
        assert_consistent(kv)
    for req in live.values():
        kv.free(req)
    assert kv.pool.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.req_blocks == {} and kv.num_cached_blocks == {}
    assert kv.pool.reset_prefix_cache()

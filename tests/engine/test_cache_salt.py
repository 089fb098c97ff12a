"""cache_salt: a salt enters a prompt's first block hash and so every later one; requests of
different salts share no prefix block (and count no hit on each other's), requests of the same
salt do, and the API server's router hashes as the engine does."""

from __future__ import annotations

from parashift.engine.block_hash import block_hashes, hash_block
from parashift.engine.kv_cache import KVCacheManager
from parashift.engine.request import Request
from parashift.serve.prefix_router import prompt_hashes
from parashift.types.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(10))  # 2 full blocks + 2 tokens


def request(request_id: str, salt: str | None, tokens: list[int] = PROMPT) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=1, cache_salt=salt), None)


def test_a_salt_changes_every_block_hash_and_only_its_own():
    plain, a, b = (block_hashes(PROMPT, BS, salt=s) for s in (None, "tenant-a", "tenant-b"))
    assert len(plain) == len(a) == len(b) == 2
    for i in range(2):  # the first block's salt carries into the chain
        assert len({plain[i], a[i], b[i]}) == 3
    assert block_hashes(PROMPT, BS, salt="tenant-a") == a  # deterministic
    assert block_hashes(PROMPT, BS, salt="") != plain  # an empty salt is still a salt
    # later blocks hash only their parent: the salt is not hashed again
    assert a[1] == hash_block(a[0], PROMPT[BS:2 * BS], salt="ignored past the first block")
    # the salt's length is hashed: no salt's tail reads as another salt's tokens
    assert hash_block(None, [0x61616161], salt="ab") != hash_block(None, [], salt="ab" + "aaaa")


def test_different_salts_share_no_block_and_count_no_hit():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    first = request("a1", "tenant-a")
    assert kv.get_computed_blocks(first) == ([], 0)
    kv.allocate_slots(first, first.num_tokens)
    for other in (request("b1", "tenant-b"), request("plain", None)):
        hits, num_hit = kv.get_computed_blocks(other)
        assert (hits, num_hit) == ([], 0)
        kv.allocate_slots(other, other.num_tokens)
        assert not set(kv.block_ids(other.request_id)) & set(kv.block_ids("a1"))
    again = request("a2", "tenant-a", PROMPT + [7])
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 2 * BS
    assert [blk.block_id for blk in hits] == kv.block_ids("a1")[:2]


def test_the_routers_salted_hashes_are_the_engines():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    salted = request("r", "tenant-a")
    kv.get_computed_blocks(salted)
    assert prompt_hashes([PROMPT], BS, "tenant-a") == [salted.block_hashes]
    assert prompt_hashes([PROMPT, PROMPT[:4]], BS) == [block_hashes(PROMPT, BS),
                                                       block_hashes(PROMPT[:4], BS)]
    assert salted.cache_salt == "tenant-a"

"""KV tiers in one engine (the offline LLM): blocks evicted from a pool of a few blocks load
back from the host tier, or after a restart from the disk tier, and give the tokens that a
local prefix hit gives (the same computation: the same cached prefix, the request alone);
an abort while loading, and two requests waiting for one load, leave nothing held; generated
tokens' blocks are stored when asked."""

from __future__ import annotations

import numpy as np
import pytest

from parashift import LLM
from parashift.engine.block_hash import block_hashes
from parashift.engine.request import Request, RequestStatus
from parashift.types.sampling_params import SamplingParams

MAX_LEN = 128
PROMPT_LEN = 100  # six whole blocks of 16 cached at most: one token is always computed
HIT = 96
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers x K/V x block x kv heads x head dim x float32
SMALL_POOL = 12 * BLOCK_BYTES  # under two prompts' blocks: each evicts the one before
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def prompts(n: int) -> list[list[int]]:
    rng = np.random.default_rng(53)
    return [[int(t) for t in rng.integers(0, 256, PROMPT_LEN)] for _ in range(n)]


def one(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    """A request alone: its tokens and its cached prompt tokens."""
    (out,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.metrics.num_cached_tokens


def tiered(model: str, **extra) -> LLM:
    return LLM(model, dtype="float32", max_model_len=MAX_LEN, kv_cache_memory=SMALL_POOL,
               kv_offloading_size=1 << 20, **extra)


@pytest.fixture(scope="module")
def reference(tiny_llama) -> dict[str, list]:
    """Each prompt cold, then as a local prefix hit, in a roomy pool."""
    llm = LLM(tiny_llama, dtype="float32", max_model_len=MAX_LEN, kv_cache_memory=4 << 20)
    try:
        cold = [one(llm, p) for p in prompts(4)]
        hit = [one(llm, p) for p in prompts(4)]
    finally:
        llm.shutdown()
    assert all(c == HIT for _, c in hit)
    return {"cold": cold, "hit": hit}


def settle(llm: LLM) -> None:
    """`generate` returns with its last request; a store that request's prefill started may
    still be on the copy thread (holding its pool blocks), and only a later step settles it,
    as the engine loop does."""
    while llm.engine.has_work():
        llm.engine.step()


def assert_nothing_held(llm: LLM) -> None:
    core = llm.engine
    pool = core.scheduler.kv_cache.pool
    settle(llm)
    assert pool.num_free_blocks == pool.num_blocks
    assert not core.connector.arena.pins.any()


def test_host_tier_serves_evicted_blocks(tiny_llama, reference):
    llm = tiered(tiny_llama)
    try:
        for p in prompts(4):
            one(llm, p)  # computed, stored; each evicts the one before from the pool
        first_block = block_hashes(prompts(1)[0], 16)[0]
        assert llm.engine.scheduler.kv_cache.pool.lookup(first_block) is None  # evicted
        assert [one(llm, p) for p in prompts(4)] == reference["hit"]
        stats = llm.engine.connector.stats
        assert stats.host_loads >= 3 and stats.host_hit_blocks >= 3 * (HIT // 16)
        assert stats.failed_loads == 0
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("decode", [False, True])
def test_decode_blocks_are_stored_when_asked(tiny_llama, decode):
    """A chat's next turn: the last prompt, its answer and a new message. With
    --kv-offloading-decode the tier holds the answer's full blocks too, so the next turn loads
    them (the same tokens as a local hit of as many blocks); without, only the prompt's."""
    first = prompts(1)[0][:90]  # 5 whole blocks and 10 tokens
    answer_params = SamplingParams(max_tokens=20, temperature=0.0)

    def turns(llm: LLM, evict: bool) -> tuple[list[int], int]:
        (out,) = llm.generate([first], answer_params, use_tqdm=False)
        if evict:
            for p in prompts(3)[1:]:
                one(llm, p)
            assert llm.engine.scheduler.kv_cache.pool.lookup(
                block_hashes(first, 16)[0]) is None
        return one(llm, first + list(out.outputs[0].token_ids) + [1, 2, 3])

    roomy = LLM(tiny_llama, dtype="float32", max_model_len=MAX_LEN, kv_cache_memory=4 << 20)
    try:
        expected = turns(roomy, evict=False)
    finally:
        roomy.shutdown()
    assert expected[1] == 96  # prompt and answer: 109 tokens computed, 6 whole blocks

    llm = tiered(tiny_llama, kv_offloading_decode=decode)
    try:
        tokens, cached = turns(llm, evict=True)
        assert cached == (96 if decode else 80)
        if decode:
            assert tokens == expected[0]
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


def _request(llm: LLM, request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, GREEDY, llm.engine.config.model.hf_config.eos_token_id)


def test_a_host_load_is_admitted_in_its_step(tiny_llama, reference):
    llm = tiered(tiny_llama)
    core = llm.engine
    try:
        for p in prompts(3):
            one(llm, p)  # the first prompt's blocks leave the pool for the tier
        settle(llm)  # (the last prompt's stores hold blocks the load needs)
        a = _request(llm, "a", prompts(1)[0])
        core.add_request(a)
        core.step()  # loaded before the step's forward, admitted in it
        assert a.status == RequestStatus.RUNNING and a.num_cached_tokens == HIT
        while core.has_unfinished_requests():
            core.step()
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


def test_abort_while_reading_and_two_requests_waiting_for_one_load(tiny_llama, reference,
                                                                    tmp_path):
    """Blocks on disk only (a restart): the request waits while they are read."""
    disk = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_size": 8 << 20}
    first = tiered(tiny_llama, **disk)
    try:
        one(first, prompts(1)[0])
    finally:
        first.shutdown()
    llm = tiered(tiny_llama, **disk)
    core = llm.engine
    try:
        a, b = (_request(llm, name, prompts(1)[0]) for name in "ab")
        core.add_request(a)
        core.add_request(b)
        core.step()  # a starts the read; b needs the same blocks and waits for a's job
        assert a.status == b.status == RequestStatus.WAITING_FOR_KV
        assert len(core.connector.jobs) == 1
        core.abort_requests(["a"])  # the read goes on; its job, not a, holds the blocks
        tokens: list[int] = []
        while core.has_unfinished_requests():
            for out in core.step():
                assert out.request_id == "b"
                tokens.extend(out.new_token_ids)
        assert (tokens, b.num_cached_tokens) == reference["hit"][0]
        assert core.connector.stats.disk_hit_blocks == HIT // 16
        assert_nothing_held(llm)
    finally:
        llm.shutdown()


def test_disk_tier_is_warm_after_a_restart_and_drops_corrupt_blocks(tiny_llama, reference,
                                                                     tmp_path):
    folder = tmp_path / "kv"
    disk = {"kv_disk_dir": str(folder), "kv_disk_size": 8 << 20}
    llm = tiered(tiny_llama, **disk)
    try:
        for p in prompts(2):
            one(llm, p)
    finally:
        llm.shutdown()  # the disk writer flushes what the arena holds
    assert len(list(folder.glob("*.kv"))) >= 2 * (HIT // 16)
    assert folder.stat().st_mode & 0o777 == 0o700

    restarted = tiered(tiny_llama, **disk)
    try:
        assert one(restarted, prompts(2)[0]) == reference["hit"][0]  # from disk
        assert restarted.engine.connector.stats.disk_hit_blocks == HIT // 16
        for path in folder.glob("*.kv"):  # flip a payload byte (after the 88-byte header)
            data = bytearray(path.read_bytes())
            data[100] ^= 0xFF
            path.write_bytes(bytes(data))
        # The second prompt's blocks are read, found corrupt, dropped: computed cold.
        assert one(restarted, prompts(2)[1]) == reference["cold"][1]
        assert restarted.engine.connector.disk.stats.dropped_corrupt >= 1
        # The writer pins the blocks it copies to disk while it copies them, in the background.
        restarted.engine.connector.stop_disk_writer()
        assert_nothing_held(restarted)
    finally:
        restarted.shutdown()


def test_a_disk_folder_others_can_read_is_refused(tiny_llama, tmp_path):
    folder = tmp_path / "open"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(ValueError, match=str(folder)):
        tiered(tiny_llama, kv_disk_dir=str(folder), kv_disk_size=8 << 20)


def test_tier_flags_are_checked():
    from parashift.config import CacheConfig

    with pytest.raises(ValueError, match="prefix caching"):
        CacheConfig(kv_offloading_size=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="go together"):
        CacheConfig(kv_offloading_size=1 << 20, kv_disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="needs --kv-offloading-size"):
        CacheConfig(kv_disk_dir="/tmp/x", kv_disk_size=1 << 20)
    with pytest.raises(ValueError, match="--kv-offloading-decode needs --kv-offloading-size"):
        CacheConfig(kv_offloading_decode=True)


def test_tensor_parallel_workers_each_copy_their_share(tiny_llama):
    """tp2: a slot holds both workers' halves of a block; a load gives a local hit's tokens."""
    common = dict(dtype="float32", max_model_len=MAX_LEN, strategy="tp2")
    roomy = LLM(tiny_llama, kv_cache_memory=4 << 20, **common)
    try:
        hit = [(one(roomy, p), one(roomy, p))[1] for p in prompts(3)]
    finally:
        roomy.shutdown()
    # Each worker holds half of a block: the same number of blocks as one worker's pool.
    llm = LLM(tiny_llama, kv_cache_memory=SMALL_POOL // 2, kv_offloading_size=1 << 20, **common)
    try:
        for p in prompts(3):
            one(llm, p)
        assert [one(llm, p) for p in prompts(3)] == hit
        assert llm.engine.connector.stats.host_hit_blocks >= 2 * (HIT // 16)
        assert_nothing_held(llm)
    finally:
        llm.shutdown()

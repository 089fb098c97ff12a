"""Prefix-aware routing, torch-free: the router's block hashes are the engine's (and do not
depend on PYTHONHASHSEED), the per-rank index is bounded and LRU, the balance guard and the
match threshold, and a pinned rank wins."""

import subprocess
import sys

import pytest

from parashift.engine.block_hash import block_hashes
from parashift.engine.kv_cache import KVCacheManager
from parashift.engine.request import Request
from parashift.serve.prefix_router import RankPrefixIndex, Router, RoutingConfig
from parashift.types.sampling_params import SamplingParams

TOKENS = [(31 * i) % 49000 for i in range(100)]


def test_the_routers_hashes_are_the_engines():
    manager = KVCacheManager(num_blocks=32, block_size=16, enable_prefix_caching=True)
    request = Request("r", TOKENS, SamplingParams(max_tokens=4), None)
    manager.get_computed_blocks(request)
    assert request.block_hashes == block_hashes(TOKENS, 16)
    assert len(request.block_hashes) == 6  # full blocks only
    longer = TOKENS + [5] * 40
    assert block_hashes(longer, 16, known=request.block_hashes[:3]) == block_hashes(longer, 16)


def test_hashes_do_not_depend_on_the_process_or_its_hash_seed():
    code = ("from parashift.engine.block_hash import block_hashes; "
            f"print(block_hashes({TOKENS!r}, 16))")
    outputs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={"PYTHONHASHSEED": seed}, check=True).stdout
               for seed in ("0", "1", "12345")}
    assert outputs == {f"{block_hashes(TOKENS, 16)}\n"}


def test_the_index_is_bounded_and_evicts_the_least_recently_routed():
    index = RankPrefixIndex(capacity=4)
    index.record([1, 2, 3])
    index.record([9, 8])  # over capacity: 1 goes
    assert list(index.blocks) == [2, 3, 9, 8]
    index.record([2])  # routed again: now the most recent
    index.record([7])
    assert list(index.blocks) == [9, 8, 2, 7] and len(index.blocks) == 4
    assert index.matched([9, 8, 5, 2]) == 2  # a chain: the first miss ends the match


def router(**config) -> Router:
    r = Router(RoutingConfig(**config), num_engines=2)
    r.add_rank(0, 100)
    r.add_rank(1, 100)
    return r


def test_a_prompt_follows_its_prefix_unless_that_rank_is_too_loaded():
    r = router(balance_threshold=4)
    prompt = block_hashes(TOKENS, 16)
    r.record(1, prompt)
    loads = {0: 0, 1: 4}
    assert r.choose([0, 1], prompt, loads.get) == 1  # 4 over the least loaded: still the cache
    loads[1] = 5
    assert r.choose([0, 1], prompt, loads.get) == 0  # past the guard: the load rule
    assert r.choose([0, 1], block_hashes([3] * 64, 16), {0: 2, 1: 0}.get) == 1  # no match: load


def test_a_weak_match_is_routed_by_load():
    r = router(min_match=0.5)
    prompt = block_hashes(TOKENS, 16)  # 6 blocks
    r.record(1, prompt[:2])
    assert r.choose([0, 1], prompt, {0: 0, 1: 1}.get) == 0  # 2 of 6 blocks: not enough
    r.record(1, prompt[:3])
    assert r.choose([0, 1], prompt, {0: 0, 1: 1}.get) == 1  # 3 of 6


def test_prompts_that_share_nothing_are_routed_exactly_as_load_routes_them():
    """The no-shared-prefix workload: the prefix policy makes the load policy's every choice
    (same loads, same tie rotation), so it cannot lose there but for noise."""
    import random

    rng = random.Random(0)
    prefix, load = router(), router(policy="load")
    loads = {0: 0, 1: 0}
    for _ in range(200):
        prompt = block_hashes([rng.randrange(100, 49000) for _ in range(rng.randrange(16, 300))],
                              16)
        choice = prefix.choose([0, 1], prompt, loads.get)
        prefix.record(choice, prompt)
        assert load.choose([0, 1], prompt, loads.get) == choice
        loads[choice] += rng.choice([1, 4])  # running or waiting
        done = rng.randrange(2)  # requests there finished
        loads[done] = max(0, loads[done] - rng.randrange(5))


def test_load_and_round_robin_ignore_the_cache():
    prompt = block_hashes(TOKENS, 16)
    load = router(policy="load")
    load.record(1, prompt)  # the load policy keeps no index
    assert not load.indexes[1].blocks
    assert load.choose([0, 1], prompt, {0: 0, 1: 3}.get) == 0
    turns = router(policy="round-robin")
    assert [turns.choose([0, 1], prompt, {0: 0, 1: 0}.get) for _ in range(4)] == [0, 1, 0, 1]


def test_a_restarted_rank_starts_with_an_empty_index():
    r = router()
    prompt = block_hashes(TOKENS, 16)
    r.record(1, prompt)
    r.add_rank(1, 100)
    assert r.indexes[1].matched(prompt) == 0


@pytest.mark.parametrize("config,message", [
    ({"policy": "cache"}, "--routing 'cache'"),
    ({"balance_threshold": -1}, "--routing-balance-threshold"),
    ({"min_match": 1.5}, "--routing-min-match")])
def test_bad_settings_name_their_flag(config, message):
    with pytest.raises(ValueError, match=message):
        RoutingConfig(**config)


def test_the_pin_wins_and_its_blocks_are_recorded_there(tmp_path):
    from parashift.serve.engine_client import EngineClient
    from parashift.wire import protocol as p

    broker = EngineClient(0, f"ipc://{tmp_path}/requests", f"ipc://{tmp_path}/outputs", 2)
    try:
        for rank in (0, 1):
            broker.on_ready(p.EngineReady(rank, 256, 100, 0, 16))
        hashes = broker.route_hashes([TOKENS], None)
        assert broker.pick_engine(hashes=hashes) == 0
        assert broker.pick_engine(hashes=hashes) == 0  # its prefix lives there now
        assert broker.pick_engine(pinned=1, hashes=hashes) == 1
        assert broker.router.indexes[1].matched(block_hashes(TOKENS, 16)) == 6
    finally:
        broker.ctx.destroy(linger=0)


def test_a_cache_emptied_through_another_api_server_is_forgotten_here(tmp_path):
    """/reset_prefix_cache or /sleep called on API server 0: server 1 hears it through the
    coordinator's load vector (the rank's reset count moved) and forgets the rank's blocks."""
    from parashift.serve.engine_client import EngineClient
    from parashift.types.outputs import SchedulerStats
    from parashift.wire import protocol as p

    broker = EngineClient(1, f"ipc://{tmp_path}/requests", f"ipc://{tmp_path}/outputs", 2)
    try:
        for rank in (0, 1):
            broker.on_ready(p.EngineReady(rank, 256, 100, 0, 16))
        hashes = block_hashes(TOKENS, 16)
        idle = SchedulerStats(0, 0, 0.0)
        broker.take_load(p.LoadVector(1, [p.EngineLoad(r, idle) for r in (0, 1)]))
        broker.router.record(0, hashes)
        broker.router.record(1, hashes)
        broker.take_load(p.LoadVector(2, [p.EngineLoad(0, idle),
                                          p.EngineLoad(1, SchedulerStats(
                                              0, 0, 0.0, num_prefix_cache_resets=1),
                                              sleep_level=1)]))
        assert broker.router.indexes[0].matched(hashes) == 6
        assert broker.router.indexes[1].matched(hashes) == 0
    finally:
        broker.ctx.destroy(linger=0)


def test_a_prefix_in_a_shared_host_tier_counts_on_every_rank_of_its_node():
    r = Router(RoutingConfig(), num_engines=3)
    r.add_rank(0, 100, "/dev/shm/node-a", 1000)
    r.add_rank(1, 100, "/dev/shm/node-a", 1000)
    r.add_rank(2, 100, "/dev/shm/node-b", 1000)
    prompt = block_hashes(TOKENS, 16)
    r.record(0, prompt)  # computed on dp0: stored in node a's tier
    loads = {0: 3, 1: 0, 2: 0}
    assert r.choose([0, 1, 2], prompt, loads.get) == 1  # node a's less loaded rank loads it
    r.forget(0)  # dp0's pool reset: the tier keeps the blocks
    assert r.choose([0, 1, 2], prompt, {0: 0, 1: 2, 2: 0}.get) == 0
    assert r.choose([2], prompt, loads.get) == 2

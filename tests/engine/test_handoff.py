"""Prefill/decode hand-off in the engine core (serve/handoff.py routes it between engines): a
prefill request stops after its first token and finishes as handed off once its prompt's
blocks are in the host tier; a request continued from those tokens loads the blocks and
generates what the request would have generated alone, bit for bit under --deterministic
(greedy, seeded with top-p, penalties); what cannot continue is refused. The scheduler with
the real connector: a hand-off waits for its stores (the first token streams meanwhile), and
an abort while they copy leaves nothing held once they end."""

from __future__ import annotations

import uuid

import pytest

from parashift import LLM, SamplingParams
from parashift.config import SchedulerConfig
from parashift.engine.block_hash import block_hashes
from parashift.engine.kv_cache import KVCacheManager
from parashift.engine.kv_tier_connector import TierConnector
from parashift.engine.request import Request, RequestStatus
from parashift.engine.scheduler import Scheduler
from parashift.kv_tiers.host_arena import HostArena
from parashift.kv_tiers.identity import tier_key
from parashift.kv_tiers.shm_files import shm_path
from parashift.types.outputs import EngineCoreOutput, KVTransferJob, ModelRunnerOutput

from .test_engine import assert_no_leaks

PROMPT = [(11 * i) % 250 + 1 for i in range(70)]  # four whole blocks of 16 and 6 tokens
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8,
                             ignore_eos=True, logprobs=3),
    "penalized": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                repetition_penalty=1.5, frequency_penalty=0.5),
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128, deterministic=True,
              kv_cache_memory=1 << 20, kv_offloading_size=1 << 20)
    yield llm
    llm.shutdown()


def drive(llm: LLM, request: Request) -> list[EngineCoreOutput]:
    """The request's outputs, the engine stepped as its loop does (while it has work)."""
    core = llm.engine
    core.add_request(request)
    outputs = []
    while core.has_work():
        outputs += [o for o in core.step() if o.request_id == request.request_id]
    return outputs


def tokens(outputs: list[EngineCoreOutput]) -> list[tuple]:
    return [(t, o.new_logprobs) for o in outputs for t in o.new_token_ids]


def cold(llm: LLM, name: str) -> list[tuple]:
    assert llm.engine.reset_prefix_cache()
    outputs = drive(llm, Request(f"cold-{name}", PROMPT, PARAMS[name], None))
    assert outputs[-1].finish_reason == "length"
    return tokens(outputs)


@pytest.mark.parametrize("name", list(PARAMS))
def test_a_handed_off_request_goes_on_with_the_same_bits(llm, name):
    reference = cold(llm, name)
    assert llm.engine.reset_prefix_cache()
    first = drive(llm, Request(f"p-{name}", PROMPT, PARAMS[name], None, hands_off=True))
    # its first token streams, then the hand-off once the blocks are in the tier
    assert [o.finish_reason for o in first] == [None, "handoff"]
    assert first[0].new_token_ids and not first[1].new_token_ids
    arena, identity = llm.engine.connector.arena, llm.engine.connector.identity
    keys = [tier_key(identity, h) for h in block_hashes(PROMPT, 16)]
    assert len(keys) == 4
    arena.unpin(arena.lookup(keys))
    assert len(arena.lookup(keys)) == 4
    arena.unpin(arena.lookup(keys))

    assert llm.engine.reset_prefix_cache()  # the decode side has none of it locally
    loads = llm.engine.connector.stats.host_hit_blocks
    generated = first[0].new_token_ids
    rest = drive(llm, Request(f"d-{name}", PROMPT, PARAMS[name], None,
                              generated_token_ids=generated))
    assert llm.engine.connector.stats.host_hit_blocks == loads + 4
    assert rest[-1].finish_reason == "length"
    assert tokens(first) + tokens(rest) == reference
    assert_no_leaks(llm)


def test_a_first_token_that_ends_it_finishes_there(llm):
    """max_tokens 1: nothing is left to hand off; the request finishes as usual."""
    out = drive(llm, Request("one", PROMPT, SamplingParams(temperature=0, max_tokens=1), None,
                             hands_off=True))
    assert [o.finish_reason for o in out] == ["length"]
    assert_no_leaks(llm)


@pytest.fixture
def tier_scheduler():
    """A scheduler with the real tier connector, its host arena and job board; the test is
    the worker that reports the copies (or does not yet)."""
    kv_cache = KVCacheManager(32, 16, True)
    arena = HostArena.open(shm_path(f"parashift-test-handoff-{uuid.uuid4().hex}"), 1 << 20,
                           1024, owner=True)
    connector = TierConnector(kv_cache, arena, b"test", 1024, num_workers=1)
    yield Scheduler(SchedulerConfig(256, 8, 128), kv_cache, connector=connector), connector
    connector.close()


def first_token(sched: Scheduler, request_id: str) -> tuple[KVTransferJob, list]:
    """Schedules the prompt whole, samples token 5: the store job and the step's outputs."""
    out = sched.schedule()
    (store,) = out.kv_jobs
    assert not store.load and store.urgent and len(store.slots) == 4
    return store, sched.update_from_output(out, ModelRunnerOutput({request_id: 5}))


def test_a_hand_off_waits_for_its_stores_and_an_abort_meanwhile_frees_all(tier_scheduler):
    sched, connector = tier_scheduler
    pool = sched.kv_cache.pool
    sched.add_request(Request("h", PROMPT, PARAMS["greedy"], None, hands_off=True))
    store, outputs = first_token(sched, "h")
    # the copy has not reported: the token streams, the request waits with its blocks stored
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([5], None)]
    assert sched.requests["h"].status == RequestStatus.SENDING_KV
    assert sched.kv_cache.req_blocks == {} and connector.storing("h")
    connector.board.report(store.job, 0, True)
    sched.schedule()
    (done,) = sched.take_unscheduled_outputs()
    assert (done.request_id, done.finish_reason) == ("h", "handoff")
    keys = [tier_key(b"test", h) for h in block_hashes(PROMPT, 16)]
    assert len(connector.arena.lookup(keys)) == 4  # published for the decode rank

    sched.add_request(Request("a", [t + 1 for t in PROMPT], PARAMS["greedy"], None,
                              hands_off=True))
    store, _ = first_token(sched, "a")
    sched.abort_requests(["a"])
    assert "a" not in sched.requests and not sched.sending_kv
    assert pool.num_free_blocks < pool.num_blocks  # the store still holds what it reads
    connector.board.report(store.job, 0, True)
    sched.schedule()
    assert not sched.take_unscheduled_outputs() and not connector.busy
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("generated, error", [
    ([1 << 20], "outside the vocabulary"),
    ([5] * 8, "no token left"),
])
def test_what_cannot_continue_is_refused(llm, generated, error):
    with pytest.raises(ValueError, match=error):
        llm.engine.add_request(Request("bad", PROMPT, PARAMS["greedy"], None,
                                       generated_token_ids=generated))
    with pytest.raises(ValueError, match="both"):
        llm.engine.add_request(Request("both", PROMPT, PARAMS["greedy"], None,
                                       generated_token_ids=[5], hands_off=True))
    assert_no_leaks(llm)


def test_an_engine_without_a_tier_refuses_a_hand_off(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128, kv_cache_memory=1 << 20)
    try:
        with pytest.raises(ValueError, match="no KV tier"):
            llm.engine.add_request(Request("x", PROMPT, PARAMS["greedy"], None,
                                           hands_off=True))
    finally:
        llm.shutdown()

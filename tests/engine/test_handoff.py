"""Prefill/decode hand-off in the engine core (serve/handoff.py routes it between engines): a
prefill request stops after its first token and finishes as handed off once its prompt's
blocks are in the host tier; a request continued from those tokens loads the blocks and
generates what the request would have generated alone, bit for bit under --deterministic
(greedy, seeded with top-p, penalties); what cannot continue is refused, and an abort while
the blocks are sent leaves nothing held."""

from __future__ import annotations

import pytest

from parashift import LLM, SamplingParams
from parashift.engine.block_hash import block_hashes
from parashift.engine.request import Request, RequestStatus
from parashift.kv_tiers.identity import tier_key
from parashift.types.outputs import EngineCoreOutput

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


def test_an_abort_while_the_blocks_are_sent(llm):
    core = llm.engine
    assert core.reset_prefix_cache()
    core.add_request(Request("ab", PROMPT, PARAMS["greedy"], None, hands_off=True))
    while "ab" in core.scheduler.requests and (
            core.scheduler.requests["ab"].status != RequestStatus.SENDING_KV):
        core.step()
    assert core.scheduler.sending_kv  # its stores are still copying
    core.abort_requests(["ab"])
    assert not core.scheduler.sending_kv and "ab" not in core.scheduler.requests
    while core.has_work():
        core.step()
    assert_no_leaks(llm)


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

"""The offline engine end to end on a tiny random-weight Llama in float32: preemption, prefix
caching and chunked prefill do not change greedy outputs, and a failed run leaves nothing
behind. The helpers here (and the check that no test leaks) serve test_engine_*.py, which test
sampling, stop conditions and input validation on the same engine (conftest.py's `llm`)."""

from __future__ import annotations

import pytest
import torch

from parashift import LLM, SamplingParams

MAX_MODEL_LEN = 256


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def random_prompts(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.requests == {}
    assert engine.scheduler.kv_cache.req_blocks == {}
    assert engine.scheduler.kv_cache.pool.num_free_blocks == engine.num_blocks
    assert llm.output_processor.parent_of == {} and llm.output_processor.requests == {}


def hit_tokens(llm: LLM) -> int:
    return llm.engine.stats().prefix_cache_hit_tokens


@pytest.fixture(autouse=True)
def _check_no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("llm"))


# ---------------------------------------------------------------------------------------------
# Scheduling does not change outputs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_tiny_kv_budget_matches_unconstrained(llm, tiny_llama, monkeypatch,
                                                               prefix_caching):
    num_blocks = 10  # 160 tokens; four requests growing to 70 tokens each need 20 blocks
    small = LLM(tiny_llama, dtype="float32", max_model_len=128,
                kv_cache_memory=num_blocks * llm.engine.executor.kv_block_bytes(),
                enable_prefix_caching=prefix_caching)
    assert small.engine.num_blocks == num_blocks
    requests = []
    add = small.engine.scheduler.add_request
    monkeypatch.setattr(small.engine.scheduler, "add_request",
                        lambda req: (requests.append(req), add(req)))

    prompts = random_prompts([30, 30, 30, 30], seed=11)
    params = [greedy(40), greedy(40, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=9, top_k=20, top_p=0.9, min_p=0.02,
                             presence_penalty=0.5, max_tokens=40, ignore_eos=True)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    got = small.generate(prompts, params, use_tqdm=False)

    assert sum(r.num_preemptions for r in requests) > 0, "the test did not force preemption"
    assert token_ids(got) == token_ids(expected)
    assert [c.text for o in got for c in o.outputs] == [c.text for o in expected
                                                        for c in o.outputs]
    assert_no_leaks(small)


def test_kv_cache_smaller_than_max_model_len_refused(llm, tiny_llama):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_llama, dtype="float32", max_model_len=128,
            kv_cache_memory=4 * llm.engine.executor.kv_block_bytes())


@pytest.mark.parametrize("budget", [16, 7])
def test_chunked_prefill_matches_one_shot(llm, tiny_llama, budget):
    chunked = LLM(tiny_llama, dtype="float32", max_model_len=MAX_MODEL_LEN,
                  kv_cache_memory=4 << 20, max_num_batched_tokens=budget,
                  enable_prefix_caching=False)
    prompts = random_prompts([5, 40, 70, 1, 17, 33], seed=12)
    expected = llm.generate(prompts, greedy(10), use_tqdm=False)
    got = chunked.generate(prompts, greedy(10), use_tqdm=False)
    assert token_ids(got) == token_ids(expected)
    assert_no_leaks(chunked)


def test_prefix_cache_hits_skip_computation_without_changing_outputs(llm, tiny_llama,
                                                                    monkeypatch):
    (prompt,) = random_prompts([100], seed=13)
    before = hit_tokens(llm)
    first = llm.generate([prompt], greedy(12), use_tqdm=False)
    assert hit_tokens(llm) == before  # a new prompt: nothing cached yet
    scheduled = []
    execute = llm.engine.executor.execute_model
    monkeypatch.setattr(llm.engine.executor, "execute_model", lambda out: (
        scheduled.append(out.total_num_scheduled_tokens), execute(out))[1])
    second = llm.generate([prompt], greedy(12), use_tqdm=False)
    monkeypatch.undo()
    # 6 full blocks of 16 are reused; only the 4 remaining prompt tokens are computed.
    assert scheduled[0] == 4
    assert hit_tokens(llm) - before == 96
    assert second[0].metrics.num_cached_tokens == 96
    assert first[0].metrics.num_cached_tokens == 0

    # A prompt sharing only the first 40 tokens reuses 2 whole blocks.
    partial = prompt[:40] + random_prompts([30], seed=14)[0]
    mid = hit_tokens(llm)
    third = llm.generate([partial], greedy(12), use_tqdm=False)
    assert hit_tokens(llm) - mid == 32

    # Two whole blocks cached, one token left: the hit is followed by a one-token "prefill".
    exact = prompt[:33]
    mid = hit_tokens(llm)
    fourth = llm.generate([exact], greedy(12), use_tqdm=False)
    assert hit_tokens(llm) - mid == 32

    # The same new prompt twice in one step: the second reads blocks the first writes in
    # that very forward pass.
    (twin,) = random_prompts([40], seed=25)
    mid = hit_tokens(llm)
    twins = llm.generate([twin, twin], greedy(12), use_tqdm=False)
    assert hit_tokens(llm) - mid == 32

    no_cache = LLM(tiny_llama, dtype="float32", max_model_len=MAX_MODEL_LEN,
                   kv_cache_memory=4 << 20, enable_prefix_caching=False)
    reference = no_cache.generate([prompt, partial, exact, twin], greedy(12), use_tqdm=False)
    assert hit_tokens(no_cache) == 0
    assert token_ids(first) == token_ids(second) == token_ids(reference[:1])
    assert token_ids(third) == token_ids(reference[1:2])
    assert token_ids(fourth) == token_ids(reference[2:3])
    assert token_ids(twins) == token_ids(reference[3:]) * 2
    assert_no_leaks(no_cache)


def test_sliding_window_model_with_prefix_hits_and_chunks(tiny_model_factory):
    """Mistral's window (48 tokens in the tiny config) with cached prefixes and chunks longer
    and shorter than the window."""
    folder = tiny_model_factory("mistral")
    common = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=4 << 20)
    plain = LLM(folder, enable_prefix_caching=False, **common)
    cached_chunked = LLM(folder, max_num_batched_tokens=20, **common)
    prompts = random_prompts([100, 60, 30], seed=23)
    expected = plain.generate(prompts, greedy(20), use_tqdm=False)
    cached_chunked.generate(prompts, greedy(1), use_tqdm=False)  # fill the prefix cache
    got = cached_chunked.generate(prompts, greedy(20), use_tqdm=False)
    assert hit_tokens(cached_chunked) >= 96 + 48 + 16
    assert token_ids(got) == token_ids(expected)


def test_reset_prefix_cache(llm):
    (prompt,) = random_prompts([40], seed=15)
    llm.generate([prompt], greedy(2), use_tqdm=False)
    assert llm.engine.reset_prefix_cache()
    before = hit_tokens(llm)
    llm.generate([prompt], greedy(2), use_tqdm=False)
    assert hit_tokens(llm) == before


# ---------------------------------------------------------------------------------------------
# Cleanup


def test_failed_run_aborts_everything_and_engine_recovers(llm):
    prompts = random_prompts([20, 35, 8], seed=22)

    def explode(sample_id: str, text: str) -> None:
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="client went away"):
        llm.generate(prompts, greedy(30), use_tqdm=False, on_output=explode)
    assert_no_leaks(llm)
    outputs = llm.generate(prompts, greedy(3), use_tqdm=False)
    assert [len(t) for t in token_ids(outputs)] == [3, 3, 3]

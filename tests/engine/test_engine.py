"""The offline engine end to end on a tiny random-weight Llama in float32: preemption, prefix
caching and chunked prefill do not change greedy outputs; seeded sampling is reproducible;
stop conditions, logprobs and input validation behave as documented; nothing leaks."""

from __future__ import annotations

import json

import pytest
import torch

from parashift import LLM, SamplingParams
from parashift.models.registry import supported_architectures

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


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    """Roomy cache, large token budget, prefix caching on: the reference configuration."""
    return LLM(tiny_llama, dtype="float32", max_model_len=MAX_MODEL_LEN,
               kv_cache_memory=4 << 20)


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
# Sampling


def test_seeded_sampling_reproducible_alone_and_in_batch(llm):
    prompts = random_prompts([12, 25, 7], seed=16)
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)
    again = llm.generate([prompts[0]], seeded, use_tqdm=False)
    batch = llm.generate(
        [prompts[1], prompts[0], prompts[2]],
        [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True), seeded,
         SamplingParams(temperature=0.7, seed=7, max_tokens=5, top_p=0.9)],
        use_tqdm=False,
    )
    other_seed = llm.generate(
        [prompts[0]], SamplingParams(temperature=1.0, seed=43, max_tokens=16, ignore_eos=True),
        use_tqdm=False)
    assert token_ids(alone) == token_ids(again) == token_ids(batch[1:2])
    assert token_ids(other_seed) != token_ids(alone)


def test_n_samples_are_distinct_and_share_prompt_blocks(llm):
    (prompt,) = random_prompts([40], seed=17)  # 2 full blocks before the last token
    before = hit_tokens(llm)
    (out,) = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=16,
                                                   ignore_eos=True), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    assert all(len(c.token_ids) == 16 and c.finish_reason == "length" for c in out.outputs)
    # Samples 2..4 reuse the prompt blocks the first one filled in the same step.
    assert hit_tokens(llm) - before == 3 * 32


def test_n_samples_with_seed_reproducible(llm):
    (prompt,) = random_prompts([20], seed=18)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)
    second = llm.generate([prompt], params, use_tqdm=False)
    assert token_ids(first) == token_ids(second)
    assert len({tuple(t) for t in token_ids(first)}) == 3


def test_frequency_and_presence_penalties_applied_to_generated_tokens(llm):
    """Greedy under additive penalties: each token is the argmax of the raw log-probabilities
    (all of them returned) minus the OpenAI penalties on the tokens generated so far."""
    vocab = llm.config.model.vocab_size
    (prompt,) = random_prompts([20], seed=24)
    frequency, presence = 0.6, 0.4
    (out,) = llm.generate([prompt], greedy(24, frequency_penalty=frequency,
                                           presence_penalty=presence, logprobs=vocab),
                          use_tqdm=False)
    c = out.outputs[0]
    counts = torch.zeros(vocab)
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        logprobs = torch.full((vocab,), -float("inf"))
        logprobs[list(entry)] = torch.tensor(list(entry.values()))
        penalized = logprobs - frequency * counts - presence * (counts > 0).float()
        assert token == int(penalized.argmax())
        counts[token] += 1
    (plain,) = llm.generate([prompt], greedy(24), use_tqdm=False)
    assert plain.outputs[0].token_ids != c.token_ids  # the tiny model repeats itself


def test_logprobs_hold_sampled_token_and_top_k(llm):
    prompts = random_prompts([9, 30], seed=19)
    outputs = llm.generate(prompts, [greedy(8, logprobs=3),
                                     SamplingParams(temperature=1.0, max_tokens=8, logprobs=2,
                                                    ignore_eos=True)], use_tqdm=False)
    for out, k in zip(outputs, (3, 2), strict=True):
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        total = 0.0
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry
            assert k <= len(entry) <= k + 1  # top-k, plus the sampled one if outside it
            assert all(v <= 0 for v in entry.values())
            assert sum(torch.tensor(list(entry.values())).exp()) <= 1 + 1e-5
            total += entry[token]
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    for token, entry in zip(outputs[0].outputs[0].token_ids, outputs[0].outputs[0].logprobs,
                            strict=True):
        assert len(entry) == 3 and entry[token] == max(entry.values())  # greedy: the top one

    (only,) = llm.generate(prompts[:1], greedy(4, logprobs=0), use_tqdm=False)
    assert [list(e) for e in only.outputs[0].logprobs] == [[t] for t in only.outputs[0].token_ids]
    (none,) = llm.generate(prompts[:1], greedy(4), use_tqdm=False)
    assert none.outputs[0].logprobs is None and none.outputs[0].cumulative_logprob is None


# ---------------------------------------------------------------------------------------------
# Stop conditions


PROMPTS_TEXT = ["Hello world, this is a test", "The quick brown fox", "abc", "Once upon a time"]


def find_printable_stop(text: str) -> str | None:
    """A two-character ASCII stop string that occurs in `text` after its first character."""
    for i in range(1, len(text) - 1):
        s = text[i : i + 2]
        if s.isascii() and s.isprintable():
            return s
    return None


def test_stop_string_cuts_text_before_it(llm):
    for prompt in PROMPTS_TEXT:
        (full,) = llm.generate(prompt, greedy(32), use_tqdm=False)
        stop = find_printable_stop(full.outputs[0].text)
        if stop is not None:
            break
    else:
        pytest.fail("no generated text holds a printable stop string")
    text, ids = full.outputs[0].text, full.outputs[0].token_ids
    cut = text.find(stop)

    (out,) = llm.generate(prompt, greedy(32, stop=["never-generated", stop]), use_tqdm=False)
    c = out.outputs[0]
    assert c.text == text[:cut]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert 0 < len(c.token_ids) < len(ids) and c.token_ids == ids[: len(c.token_ids)]

    (kept,) = llm.generate(prompt, greedy(32, stop=stop, include_stop_str_in_output=True),
                           use_tqdm=False)
    assert kept.outputs[0].text == text[: cut + len(stop)]
    assert kept.outputs[0].token_ids == c.token_ids


def test_stop_string_on_last_allowed_token_reports_stop(llm):
    prompt = PROMPTS_TEXT[0]
    (full,) = llm.generate(prompt, greedy(32), use_tqdm=False)
    stop = find_printable_stop(full.outputs[0].text)
    assert stop is not None
    (first,) = llm.generate(prompt, greedy(32, stop=stop), use_tqdm=False)
    num_tokens = len(first.outputs[0].token_ids)  # the token that completes the stop string
    (out,) = llm.generate(prompt, greedy(num_tokens, stop=stop), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == first.outputs[0].token_ids and c.text == first.outputs[0].text
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)


def test_stop_token_ids(llm):
    (prompt,) = random_prompts([15], seed=20)
    (full,) = llm.generate([prompt], greedy(24), use_tqdm=False)
    ids = full.outputs[0].token_ids
    stop_token = ids[6]
    end = ids.index(stop_token) + 1
    (out,) = llm.generate([prompt], greedy(24, stop_token_ids=[stop_token]), use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ids[:end]
    assert c.finish_reason == "stop" and c.stop_reason == stop_token


def test_eos_stops_unless_ignored(llm):
    eos = llm.eos_token_id
    for prompt in PROMPTS_TEXT:
        (full,) = llm.generate(prompt, greedy(48), use_tqdm=False)
        if eos in full.outputs[0].token_ids:
            break
    else:
        pytest.fail("the tiny model never produced EOS for any test prompt")
    ids = full.outputs[0].token_ids
    end = ids.index(eos) + 1
    assert full.outputs[0].finish_reason == "length" and len(ids) == 48

    (out,) = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48),
                          use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ids[:end]
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert "</s>" not in c.text  # special tokens skipped


def test_max_tokens_and_max_model_len_give_length(llm):
    prompts = random_prompts([10, MAX_MODEL_LEN - 3], seed=21)
    outputs = llm.generate(prompts, [greedy(5), SamplingParams(temperature=0.0, max_tokens=None,
                                                               ignore_eos=True)],
                           use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5, 3]
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n must"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_mutated_after_construction_rejected_by_generate(llm):
    params = SamplingParams()
    params.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)


def test_bad_prompts_rejected(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * MAX_MODEL_LEN], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 100_000]], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate([[1], [2]], [greedy(1)], use_tqdm=False)
    # The longest allowed prompt leaves room for one token.
    (out,) = llm.generate([[1] * (MAX_MODEL_LEN - 1)], greedy(5), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1


def test_rejected_batch_leaves_nothing_queued(llm):
    try:
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([[1, 2, 3], [1] * MAX_MODEL_LEN], greedy(4), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert llm.output_processor.parent_of == {}
    finally:  # keep the shared engine clean for the other tests
        llm.engine.abort_requests(list(llm.engine.scheduler.requests))
        llm.output_processor.parent_of.clear()
        llm.output_processor.requests.clear()


def test_unknown_model_path_rejected(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 1, "n_head": 2,
        "n_embd": 8, "vocab_size": 16,
    }))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        LLM(str(tmp_path))
    supported = supported_architectures()
    assert supported and all(name in str(info.value) for name in supported)


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


def test_the_engine_refuses_a_token_id_past_its_embedding(llm):
    """What an API server lets through (a tokenizer larger than the model) fails alone in the
    engine instead of crashing its step."""
    from parashift.engine.request import Request

    vocab = llm.engine.config.model.vocab_size
    with pytest.raises(ValueError, match=f"token id {vocab} is outside"):
        llm.engine.add_request(Request("bad", [1, vocab], greedy(1), None))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        llm.engine.add_request(Request("bad", [-1], greedy(1), None))
    assert not llm.engine.has_unfinished_requests()

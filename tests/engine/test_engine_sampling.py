"""The offline engine's sampling (test_engine.py's engine and helpers): seeded sampling is
reproducible alone and in a batch, n samples are distinct and share their prompt's blocks,
penalties apply to generated tokens, logprobs hold the sampled token and the top k."""

from __future__ import annotations

import pytest
import torch

from parashift import SamplingParams

from .test_engine import (  # noqa: F401 (_check_no_leaks: the autouse check after each test)
    _check_no_leaks,
    greedy,
    hit_tokens,
    random_prompts,
    token_ids,
)


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

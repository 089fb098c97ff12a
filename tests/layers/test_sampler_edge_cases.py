"""The Sampler's greedy rows and the edge cases of each filter (top-k ties, top-p at its
boundary, min-p, masked tokens), per row, on both implementations (test_sampler.py's fixture
and helpers); the logits it is given stay unchanged."""

from __future__ import annotations

import torch
from test_sampler import (  # noqa: F401 (implementation: every test on both paths)
    LOGITS,
    LOGITS12,
    assert_follows,
    draw,
    implementation,
    metadata,
    penalties,
    reference_probs,
)

from parashift.layers.sampler import Sampler, position_seed


def test_greedy_is_argmax():
    logits = torch.randn(16, 50)
    tokens, logprobs = Sampler()(logits, metadata(16, temperature=0.0))
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 16


def test_batch_mixing_greedy_seeded_and_random_rows():
    logits = torch.randn(9, 50)
    temps = [0.0, 1.0, 0.8] * 3
    seeds = {2: position_seed(1, 0), 5: position_seed(2, 0), 8: position_seed(3, 0)}
    tokens, _ = Sampler()(logits, metadata(9, temperature=temps, top_k=[0, 10, 5] * 3,
                                           seeds=seeds))
    assert tokens[::3] == logits.argmax(dim=-1).tolist()[::3]
    for row, seed in seeds.items():  # each seeded row as if it were alone
        alone, _ = Sampler()(logits[row:row + 1].clone(),
                             metadata(1, temperature=0.8, top_k=5, seeds={0: seed}))
        assert tokens[row] == alone[0]


def test_top_k_one_and_temperature_near_zero_are_greedy():
    assert set(draw(LOGITS, 500, top_k=1).tolist()) == {int(LOGITS.argmax())}
    logits = torch.randn(64, 40)
    tokens, _ = Sampler()(logits, metadata(64, temperature=1e-4))
    assert tokens == logits.argmax(dim=-1).tolist()
    tokens, _ = Sampler()(logits, metadata(64, temperature=1e-40))  # 1/t overflows
    assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_every_tie_at_the_kth_value():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.0])
    assert set(draw(logits, 4000, top_k=2).tolist()) == {0, 2, 3, 4}


def test_top_k_at_or_above_vocab_and_top_p_one_filter_nothing():
    for kwargs in ({"top_k": 12}, {"top_k": 120}, {"top_p": 1.0}):
        assert_follows(draw(LOGITS12, **kwargs), reference_probs(LOGITS12))


def test_top_p_keeps_smallest_set_reaching_p():
    # Sorted probabilities 0.5, 0.3, 0.1, ...: p = 0.75 keeps {0.5, 0.3}; p = 0.85 adds 0.1.
    for top_p, expected in ((0.75, {1, 3}), (0.85, {1, 3, 4}), (0.3, {1})):
        tokens = draw(LOGITS, top_p=top_p)
        assert set(tokens.tolist()) == expected, top_p
        assert_follows(tokens, reference_probs(LOGITS, top_p=top_p))


def test_top_p_with_one_dominant_token_and_ties_at_the_boundary():
    dominant = torch.tensor([8.0, 0.0, 0.1, -1.0])
    assert set(draw(dominant, 2000, top_p=0.9).tolist()) == {0}
    tied = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2]))  # 0.5 is reached inside the tie
    assert set(draw(tied, 4000, top_p=0.5).tolist()) == {0, 1, 2, 3}


def test_min_p_drops_tokens_below_fraction_of_max():
    # max prob 0.5: min_p 0.15 -> threshold 0.075 keeps 0.5, 0.3, 0.1
    assert set(draw(LOGITS, min_p=0.15).tolist()) == {1, 3, 4}


def test_filters_are_per_row():
    num = 3000
    logits = LOGITS.expand(2 * num, -1).clone()
    md = metadata(2 * num, top_k=[1] * num + [0] * num, top_p=[1.0] * num + [0.75] * num)
    tokens = torch.tensor(Sampler()(logits, md)[0])
    assert set(tokens[:num].tolist()) == {1}
    assert set(tokens[num:].tolist()) == {1, 3}


def test_masked_minus_inf_tokens_never_sampled():
    logits = torch.tensor([0.0, -float("inf"), 1.0, -float("inf")])
    for kwargs in ({"temperature": 3.0}, {"top_p": 0.99}, {"top_k": 3}, {"min_p": 1e-9}):
        assert set(draw(logits, 5000, **kwargs).tolist()) == {0, 2}, kwargs
    everything_masked = torch.full((1, 4), -float("inf"))
    assert Sampler()(everything_masked, metadata(1))[0] in ([0], [1], [2], [3])


def test_input_logits_not_modified():
    logits = torch.randn(4, 20)
    before = logits.clone()
    md = metadata(4, temperature=[0.0, 0.5, 1.0, 2.0], top_k=5, top_p=0.9, min_p=0.1,
                  num_logprobs=[2] * 4,
                  penalties=penalties(4, [[1, 2]] * 4, [[3, 3]] * 4, 1.5, 0.5, 0.5))
    Sampler()(logits, md)
    assert torch.equal(logits, before)

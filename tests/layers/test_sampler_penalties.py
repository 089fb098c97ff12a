"""Penalties from kept token counts, on both sampler implementations (test_sampler.py's fixture
and helpers): counts grow across steps; repetition, frequency and presence penalties follow
their definitions, per row, and change a greedy choice."""

from __future__ import annotations

import pytest
import torch
from test_sampler import (  # noqa: F401 (implementation: every test on both paths)
    VOCAB,
    implementation,
    metadata,
    penalties,
)

from parashift.layers.penalties import PenaltyInputs, TokenCounts, apply_penalties
from parashift.layers.sampler import Sampler


def test_token_counts_grow_across_steps():
    counts = TokenCounts([5, 1, 5], [2])
    counts.add([2, 7])
    for _ in range(40):  # past the first capacity
        counts.add([100])
    seen = dict(zip(counts.token_ids.tolist(), counts.output_counts.tolist(), strict=True))
    assert seen == {5: 0.0, 1: 0.0, 2: 2.0, 7: 1.0, 100: 40.0}


def test_repetition_penalty_divides_positive_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5, 1.0]])
    apply_penalties(logits, penalties(1, [[0, 1]], [[3]], repetition=2.0))
    # seen: 0, 1 (prompt) and 3 (output); 2, 4, 5 unchanged
    assert logits.tolist() == [[1.0, -4.0, 3.0, -2.0, 0.5, 1.0]]


def test_frequency_and_presence_penalties_follow_openai():
    # OpenAI: logit -= count * frequency_penalty + (count > 0) * presence_penalty,
    # counting generated tokens only (prompt tokens are not penalised).
    logits = torch.zeros(1, VOCAB)
    apply_penalties(logits, penalties(1, [[4, 4, 5]], [[1, 1, 1, 2]], frequency=0.5,
                                      presence=0.25))
    assert logits.tolist() == [[0.0, -1.75, -0.75, 0.0, 0.0, 0.0]]


def test_penalties_are_per_row():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    counts = [TokenCounts([], [2]), None, TokenCounts([], [2])]
    apply_penalties(logits, PenaltyInputs.gather(counts, [1.0, 5.0, 3.0], [0.0, 5.0, 1.0],
                                                 [0.0] * 3, torch.device("cpu")))
    assert logits[0].tolist() == [1.0, 2.0, 3.0]
    assert logits[1].tolist() == [1.0, 2.0, 3.0]  # no counts: untouched
    assert logits[2].tolist() == pytest.approx([1.0, 2.0, 0.0])  # 3 / 3 - 1


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    md = metadata(1, temperature=0.0, penalties=penalties(1, [[]], [[0]], presence=1.0))
    assert Sampler()(logits, md)[0] == [1]

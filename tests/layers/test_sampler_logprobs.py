"""The sampler's logprobs, on both implementations (test_sampler.py's fixture and helpers): the
sampled token first, then the top k, with its rank, all of the raw logits (before penalties
and filters)."""

from __future__ import annotations

import math

import pytest
import torch
from test_sampler import (  # noqa: F401 (implementation: every test on both paths)
    implementation,
    metadata,
    penalties,
)

from parashift.layers.sampler import Sampler


def test_logprobs_sampled_token_first_then_top_k():
    logits = torch.randn(4, 30)
    md = metadata(4, temperature=[0.0, 1.0, 1.0, 0.0], num_logprobs=[3, 0, None, 5])
    tokens, lps = Sampler()(logits, md)
    raw = logits.log_softmax(-1)
    assert lps[2] is None
    for row, n in ((0, 3), (1, 0), (3, 5)):
        lp = lps[row]
        assert len(lp.token_ids) == len(lp.logprobs) == n + 1
        assert lp.token_ids[0] == tokens[row]
        assert lp.token_ids[1:] == raw[row].topk(n).indices.tolist()
        for token, value in zip(lp.token_ids, lp.logprobs, strict=True):
            assert math.isclose(value, float(raw[row, token]), abs_tol=1e-5)
        assert lp.sampled_rank == int((raw[row] > raw[row, tokens[row]]).sum()) + 1
    assert lps[0].sampled_rank == 1 and lps[3].sampled_rank == 1  # greedy rows


def test_logprobs_are_of_raw_logits_not_processed():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    md = metadata(1, temperature=0.0, num_logprobs=[2],
                  penalties=penalties(1, [[]], [[0]], presence=1.0))
    tokens, (lp,) = Sampler()(logits, md)
    raw = logits.log_softmax(-1)[0]
    assert tokens == [1] and lp.sampled_rank == 2
    assert lp.token_ids == [1, 0, 1]
    assert lp.logprobs == pytest.approx([float(raw[1]), float(raw[0]), float(raw[1])])

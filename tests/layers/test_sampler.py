"""The Sampler on synthetic logits: greedy, the masking filters (top-k, top-p, min-p), the
sampled distribution, penalties as specified, seeded rows and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from parashift.layers.sampler import Sampler, SamplingMetadata, apply_penalties, position_seed

VOCAB = 6
# Probabilities 0.5, 0.3, 0.1, 0.06, 0.04, 0.0 (the last masked out by -inf in some tests)
PROBS = torch.tensor([0.04, 0.5, 0.06, 0.3, 0.1, 1e-9])
LOGITS = PROBS.log()


def metadata(num_rows: int, temperature: float | list[float] = 1.0, top_k=None, top_p=None,
             min_p=None, seeds: dict[int, int] | None = None, num_logprobs=None,
             penalties: dict | None = None, vocab: int = VOCAB) -> SamplingMetadata:
    def column(value, dtype):
        values = value if isinstance(value, list) else [value] * num_rows
        return torch.tensor(values, dtype=dtype)

    temp = column(temperature, torch.float32)
    md = SamplingMetadata(
        temperature=temp,
        all_greedy=bool((temp == 0).all()),
        top_k=None if top_k is None else column(top_k, torch.int64),
        top_p=None if top_p is None else column(top_p, torch.float32),
        min_p=None if min_p is None else column(min_p, torch.float32),
        seeds=seeds or {},
        presence_penalty=None, frequency_penalty=None, repetition_penalty=None,
        prompt_token_ids=None, output_token_ids=None,
        num_logprobs=num_logprobs if num_logprobs is not None else [None] * num_rows,
    )
    if penalties is not None:
        md.presence_penalty = column(penalties.get("presence", 0.0), torch.float32)
        md.frequency_penalty = column(penalties.get("frequency", 0.0), torch.float32)
        md.repetition_penalty = column(penalties.get("repetition", 1.0), torch.float32)
        md.prompt_token_ids = padded(penalties.get("prompt", [[]] * num_rows), vocab)
        md.output_token_ids = padded(penalties.get("output", [[]] * num_rows), vocab)
    return md


def padded(rows: list[list[int]], vocab: int) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=torch.int64)


def draw(logits: torch.Tensor, num_draws: int, **kwargs) -> torch.Tensor:
    """`num_draws` independent samples from one row of logits, as one batch."""
    tokens, _ = Sampler()(logits.expand(num_draws, -1).clone(), metadata(num_draws, **kwargs))
    return torch.tensor(tokens)


def frequencies(tokens: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(1234)


# ---------------------------------------------------------------------------------------------
# Greedy and the temperature limit


def test_greedy_is_argmax():
    logits = torch.randn(16, 50)
    tokens, logprobs = Sampler()(logits, metadata(16, temperature=0.0))
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 16


def test_greedy_rows_mixed_with_random_rows_stay_argmax():
    logits = torch.randn(8, 50)
    temps = [0.0, 1.0] * 4
    tokens, _ = Sampler()(logits, metadata(8, temperature=temps))
    argmax = logits.argmax(dim=-1).tolist()
    assert [t for t, temp in zip(tokens, temps, strict=True) if temp == 0] == argmax[::2]


def test_top_k_one_is_greedy():
    assert set(draw(LOGITS, 500, top_k=1).tolist()) == {int(LOGITS.argmax())}


def test_temperature_to_zero_approaches_greedy():
    logits = torch.randn(64, 40)
    tokens, _ = Sampler()(logits, metadata(64, temperature=1e-4))
    assert tokens == logits.argmax(dim=-1).tolist()


def test_input_logits_not_modified():
    logits = torch.randn(4, 20)
    before = logits.clone()
    md = metadata(4, temperature=[0.0, 0.5, 1.0, 2.0], top_k=5, top_p=0.9, min_p=0.1,
                  num_logprobs=[2] * 4, vocab=20,
                  penalties={"repetition": 1.5, "frequency": 0.5, "presence": 0.5,
                             "prompt": [[1, 2]] * 4, "output": [[3, 3]] * 4})
    Sampler()(logits, md)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------------
# Distributions (statistical; seeded global RNG, tolerances of many standard deviations)

NUM_DRAWS = 20_000
TOL = 0.02  # > 5 sigma for p(1-p)/N at N = 20k


def test_plain_sampling_follows_softmax():
    freq = frequencies(draw(LOGITS, NUM_DRAWS))
    assert torch.allclose(freq, PROBS / PROBS.sum(), atol=TOL)


def test_temperature_scales_logits():
    freq = frequencies(draw(LOGITS, NUM_DRAWS, temperature=2.0))
    assert torch.allclose(freq, (LOGITS / 2.0).softmax(-1), atol=TOL)


def test_top_k_never_picks_masked_tokens():
    tokens = draw(LOGITS, NUM_DRAWS, top_k=3)
    top3 = set(LOGITS.topk(3).indices.tolist())
    assert set(tokens.tolist()) == top3  # every kept token shows up, nothing else does
    kept = torch.zeros(VOCAB)
    kept[list(top3)] = PROBS[list(top3)]
    assert torch.allclose(frequencies(tokens), kept / kept.sum(), atol=TOL)


def test_top_p_keeps_smallest_set_reaching_p():
    # Sorted probabilities 0.5, 0.3, 0.1, ...: p = 0.75 keeps {0.5, 0.3}; p = 0.85 adds 0.1.
    for top_p, expected in ((0.75, {1, 3}), (0.85, {1, 3, 4}), (0.3, {1})):
        tokens = draw(LOGITS, NUM_DRAWS, top_p=top_p)
        assert set(tokens.tolist()) == expected, top_p
        kept = torch.zeros(VOCAB)
        kept[list(expected)] = PROBS[list(expected)]
        assert torch.allclose(frequencies(tokens), kept / kept.sum(), atol=TOL)


def test_min_p_drops_tokens_below_fraction_of_max():
    # max prob 0.5: min_p 0.15 -> threshold 0.075 keeps 0.5, 0.3, 0.1
    tokens = draw(LOGITS, NUM_DRAWS, min_p=0.15)
    assert set(tokens.tolist()) == {1, 3, 4}


def test_top_k_and_top_p_per_row():
    # Different filters per row in one batch: each row respects only its own.
    num = 3000
    logits = LOGITS.expand(2 * num, -1).clone()
    md = metadata(2 * num, top_k=[1] * num + [VOCAB] * num, top_p=[1.0] * num + [0.75] * num)
    tokens = torch.tensor(Sampler()(logits, md)[0])
    assert set(tokens[:num].tolist()) == {1}
    assert set(tokens[num:].tolist()) == {1, 3}


def test_masked_minus_inf_tokens_never_sampled():
    logits = torch.tensor([0.0, -float("inf"), 1.0, -float("inf")])
    tokens = draw(logits, 5000, temperature=3.0)
    assert set(tokens.tolist()) == {0, 2}


# ---------------------------------------------------------------------------------------------
# Penalties


def test_repetition_penalty_divides_positive_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5, 1.0]])
    md = metadata(1, penalties={"repetition": 2.0, "prompt": [[0, 1]], "output": [[3]]})
    out = apply_penalties(logits, md)
    # seen: 0, 1 (prompt) and 3 (output); 2, 4, 5 unchanged
    assert out.tolist() == [[1.0, -4.0, 3.0, -2.0, 0.5, 1.0]]


def test_frequency_and_presence_penalties_follow_openai():
    # OpenAI: logit -= count * frequency_penalty + (count > 0) * presence_penalty,
    # counting generated tokens only (prompt tokens are not penalised).
    logits = torch.zeros(1, VOCAB)
    md = metadata(1, penalties={"frequency": 0.5, "presence": 0.25, "prompt": [[4, 4, 5]],
                                "output": [[1, 1, 1, 2]]})
    out = apply_penalties(logits, md)
    assert out.tolist() == [[0.0, -1.75, -0.75, 0.0, 0.0, 0.0]]


def test_penalties_are_per_row_and_neutral_by_default():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    md = metadata(2, vocab=3, penalties={"repetition": [1.0, 3.0], "frequency": [0.0, 1.0],
                                         "output": [[2], [2]]})
    out = apply_penalties(logits, md)
    assert out[0].tolist() == [1.0, 2.0, 3.0]
    assert out[1].tolist() == pytest.approx([1.0, 2.0, 0.0])  # 3 / 3 - 1


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    md = metadata(1, temperature=0.0, vocab=3, penalties={"presence": 1.0, "output": [[0]]})
    assert Sampler()(logits, md)[0] == [1]


# ---------------------------------------------------------------------------------------------
# Seeded rows


def test_seeded_row_independent_of_batch():
    logits = torch.randn(1, 50)
    for seed in range(20):
        s = position_seed(seed, 0)
        alone, _ = Sampler()(logits.clone(), metadata(1, seeds={0: s}))
        # Same row at a different index, next to random and other seeded rows.
        others = torch.randn(4, 50)
        batch = torch.cat([others[:2], logits, others[2:]])
        mixed, _ = Sampler()(batch, metadata(5, temperature=[1.0, 0.7, 1.0, 0.0, 1.3],
                                             seeds={2: s, 4: position_seed(seed + 1, 0)}))
        assert mixed[2] == alone[0], seed


def test_seeded_rows_vary_with_seed_and_position():
    logits = torch.zeros(1, 1000)  # uniform: distinct seeds should give distinct tokens
    by_seed = {Sampler()(logits.clone(), metadata(1, seeds={0: position_seed(s, 0)}))[0][0]
               for s in range(20)}
    by_position = {Sampler()(logits.clone(), metadata(1, seeds={0: position_seed(3, p)}))[0][0]
                   for p in range(20)}
    assert len(by_seed) > 15 and len(by_position) > 15


def test_seeded_draws_follow_distribution():
    freq = frequencies(torch.tensor([
        Sampler()(LOGITS[None].clone(), metadata(1, seeds={0: position_seed(s, 0)}))[0][0]
        for s in range(4000)]))
    assert torch.allclose(freq, PROBS / PROBS.sum(), atol=0.04)


# ---------------------------------------------------------------------------------------------
# Logprobs


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
        assert all(v <= 0 for v in lp.logprobs)
        assert lp.token_ids[1:] == raw[row].topk(n).indices.tolist()
        for token, value in zip(lp.token_ids, lp.logprobs, strict=True):
            assert math.isclose(value, float(raw[row, token]), abs_tol=1e-5)
        assert lp.sampled_rank == int((raw[row] > raw[row, tokens[row]]).sum()) + 1
    assert lps[0].sampled_rank == 1 and lps[3].sampled_rank == 1  # greedy rows


def test_logprobs_are_of_raw_logits_not_processed():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    md = metadata(1, temperature=0.0, vocab=3, num_logprobs=[2],
                  penalties={"presence": 1.0, "output": [[0]]})
    tokens, (lp,) = Sampler()(logits, md)
    raw = logits.log_softmax(-1)[0]
    assert tokens == [1] and lp.sampled_rank == 2
    assert lp.token_ids == [1, 0, 1]
    assert lp.logprobs == pytest.approx([float(raw[1]), float(raw[0]), float(raw[1])])

"""The Sampler on synthetic logits, through both implementations (the CPU kernel and the batched
torch ops used on GPU): distributions against a plain-torch reference (full sort, softmax,
multinomial) by a chi-square test, the edge cases of each filter, penalties from kept counts,
seeded rows and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

import parashift.layers.sampler as sampler_module
from parashift.layers.kernel_dispatch import cpu_ops
from parashift.layers.penalties import PenaltyInputs, TokenCounts, apply_penalties
from parashift.layers.sampler import (
    Sampler,
    SamplingMetadata,
    position_seed,
    row_uniforms,
    sample_rows,
    seeded_uniform,
)

VOCAB = 6
# Probabilities 0.5, 0.3, 0.1, 0.06, 0.04, 0.0 (the last masked out by -inf in some tests)
PROBS = torch.tensor([0.04, 0.5, 0.06, 0.3, 0.1, 1e-9])
LOGITS = PROBS.log()
NUM_DRAWS = 20_000


@pytest.fixture(params=["kernel", "torch"], autouse=True)
def implementation(request, monkeypatch):
    """Every test runs on the compiled CPU kernel and on the torch path."""
    if request.param == "kernel":
        assert cpu_ops() is not None, "the CPU kernels did not build here"
    else:
        monkeypatch.setattr(sampler_module, "on_cpu_kernels", lambda x: False)
    torch.manual_seed(1234)
    return request.param


def metadata(num_rows: int, temperature: float | list[float] = 1.0, top_k=None, top_p=None,
             min_p=None, seeds: dict[int, int] | None = None, num_logprobs=None,
             penalties: PenaltyInputs | None = None) -> SamplingMetadata:
    def column(value, dtype):
        values = value if isinstance(value, list) else [value] * num_rows
        return torch.tensor(values, dtype=dtype)

    temp = column(temperature, torch.float32)
    all_greedy = bool((temp == 0).all())
    return SamplingMetadata(
        temperature=temp, all_greedy=all_greedy,
        top_k=None if top_k is None else column(top_k, torch.int64),
        top_p=None if top_p is None else column(top_p, torch.float32),
        min_p=None if min_p is None else column(min_p, torch.float32),
        uniforms=None if all_greedy else row_uniforms(num_rows, seeds or {}, torch.device("cpu")),
        penalties=penalties,
        num_logprobs=num_logprobs if num_logprobs is not None else [None] * num_rows,
    )


def penalties(num_rows: int, prompt: list[list[int]], output: list[list[int]],
              repetition=1.0, frequency=0.0, presence=0.0) -> PenaltyInputs:
    def per_row(value):
        return value if isinstance(value, list) else [value] * num_rows

    counts = [TokenCounts(p, o) for p, o in zip(prompt, output, strict=True)]
    return PenaltyInputs.gather(counts, per_row(repetition), per_row(frequency),
                                per_row(presence), torch.device("cpu"))


def draw(logits: torch.Tensor, num_draws: int = NUM_DRAWS, **kwargs) -> torch.Tensor:
    """`num_draws` independent samples from one row of logits, as one batch."""
    tokens, _ = Sampler()(logits.expand(num_draws, -1).clone(), metadata(num_draws, **kwargs))
    return torch.tensor(tokens)


def reference_probs(logits: torch.Tensor, temperature=1.0, top_k=None, top_p=None, min_p=None,
                    rep=1.0, freq=0.0, pres=0.0, prompt=(), output=()) -> torch.Tensor:
    """vLLM's definitions in plain torch, one row: penalties, temperature, min-p, then top-k and
    top-p by a full sort."""
    x = logits.clone().float()
    counts = torch.bincount(torch.tensor(list(output), dtype=torch.long),
                            minlength=x.numel()).float()
    seen = counts > 0
    seen[list(prompt)] = True
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - freq * counts - pres * (counts > 0).float()
    x = x / temperature
    if min_p is not None:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.max(), -float("inf"))
    if top_k is not None and top_k < x.numel():
        x = x.masked_fill(x < x.topk(top_k).values[-1], -float("inf"))
    if top_p is not None:
        ascending, order = x.sort()
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[-1] = False
        x[order[drop]] = -float("inf")
    return x.softmax(-1)


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit at p = 1e-4 (Wilson-Hilferty), and no token of probability 0."""
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * len(tokens)
    assert observed[probs == 0].sum() == 0, "a filtered-out token was drawn"
    live = expected > 0
    df = int(live.sum()) - 1
    if df == 0:
        return
    chi2 = float(((observed[live] - expected[live]) ** 2 / expected[live]).sum())
    z = 3.719  # the normal quantile of 1 - 1e-4
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < bound, f"chi2 {chi2:.1f} over {bound:.1f} ({df} df): {observed} vs {expected}"


# ---------------------------------------------------------------------------------------------
# Distributions against the reference, every mode and combination

LOGITS12 = torch.tensor([1.2, -0.3, 2.5, 0.1, 0.9, -1.7, 1.9, 0.4, -0.8, 2.2, -2.5, 0.6])
MODES = {
    "temperature 1": {},
    "temperature 0.7": {"temperature": 0.7},
    "temperature 1.8": {"temperature": 1.8},
    "top-k 4": {"top_k": 4},
    "top-p 0.8": {"top_p": 0.8},
    "min-p 0.15": {"min_p": 0.15},
    "top-k 6, top-p 0.9, temperature 0.8": {"top_k": 6, "top_p": 0.9, "temperature": 0.8},
    "min-p 0.05, top-p 0.7": {"min_p": 0.05, "top_p": 0.7},
    "min-p 0.2, top-k 3, top-p 0.95, temperature 1.3": {"min_p": 0.2, "top_k": 3, "top_p": 0.95,
                                                        "temperature": 1.3},
}


@pytest.mark.parametrize("mode", MODES)
def test_distribution_matches_reference(mode):
    kwargs = MODES[mode]
    assert_follows(draw(LOGITS12, **kwargs), reference_probs(LOGITS12, **kwargs))


@pytest.mark.parametrize("kwargs", [
    {"rep": 1.6, "prompt": [2, 5], "output": [9, 9, 3]},
    {"freq": 0.7, "pres": 0.4, "prompt": [0], "output": [2, 2, 2, 6]},
    {"rep": 1.3, "freq": 0.3, "pres": 0.2, "prompt": [1, 2], "output": [9, 6, 6],
     "temperature": 0.9, "top_p": 0.85, "top_k": 5},
], ids=["repetition", "frequency+presence", "all with filters"])
def test_penalized_distribution_matches_reference(kwargs):
    sampling = {k: kwargs[k] for k in ("temperature", "top_p", "top_k") if k in kwargs}
    pen = penalties(NUM_DRAWS, [kwargs.get("prompt", [])] * NUM_DRAWS,
                    [kwargs.get("output", [])] * NUM_DRAWS, kwargs.get("rep", 1.0),
                    kwargs.get("freq", 0.0), kwargs.get("pres", 0.0))
    tokens = draw(LOGITS12, penalties=pen, **sampling)
    assert_follows(tokens, reference_probs(LOGITS12, **kwargs))


def test_kernel_and_torch_path_agree_on_a_real_sized_vocabulary(implementation):
    """The same uniforms give the same tokens on 49,152-token rows, each filter exercised: a
    peaked row, a flat one (top-p's candidates cannot hold the mass) and one with ties."""
    if implementation == "torch":
        pytest.skip("compares the two paths once")
    g = torch.Generator().manual_seed(0)
    rows = 24
    logits = torch.randn(rows, 49_152, generator=g) * 2
    logits[::3] *= 4  # peaked
    logits[1::3] = -10 + torch.rand(49_152, generator=g)  # flat
    logits[1::3, 7] = 0.0
    logits[2::3, :40] = logits[2::3].max(dim=-1, keepdim=True).values  # a tie of 40 at the top
    for kwargs in ({}, {"top_k": 50}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 2000},
                   {"top_k": 30, "top_p": 0.8, "min_p": 0.01}):
        md = metadata(rows, temperature=0.8, **kwargs)
        for dtype in (torch.float32, torch.bfloat16):
            x = logits.to(dtype)
            kernel = cpu_ops().sample(x, md.temperature, md.top_k, md.top_p, md.min_p,
                                      md.uniforms)
            torch_path = sample_rows(x, md.temperature, md.top_k, md.top_p, md.min_p,
                                     md.uniforms)
            assert kernel.tolist() == torch_path.tolist(), (kwargs, dtype)
    # Penalties: the kernel reads them as overrides, the torch path from a penalized copy.
    pen = penalties(rows, [list(range(0, 3000, 7))] * rows, [[1, 2, 2, 7, 40]] * rows, 1.3, 0.4,
                    0.6)
    md = metadata(rows, temperature=[0.0, 0.9] * (rows // 2), top_p=0.9, penalties=pen)
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype)
        kernel, _ = Sampler()(x, md)
        copy = x.float()
        apply_penalties(copy, pen)
        torch_path = sample_rows(copy, md.temperature, None, md.top_p, None, md.uniforms)
        assert kernel == torch_path.tolist(), dtype


def test_kernel_refuses_malformed_overrides(implementation):
    if implementation == "torch":
        pytest.skip("a kernel argument")
    logits, md = torch.randn(2, 10), metadata(2)
    good = (torch.tensor([0, 1, 2]), torch.tensor([3, 4]), torch.tensor([1.0, 2.0]))
    cpu_ops().sample(logits, md.temperature, None, None, None, md.uniforms, good)
    for bad in ((torch.tensor([0, 1, 2]), torch.tensor([3, 10]), good[2]),  # id past the vocab
                (torch.tensor([0, 2, 1]), good[1], good[2]),  # starts going back
                (torch.tensor([0, 1, 3]), good[1], good[2]),  # past the ids
                (good[0], good[1], good[2].double())):
        with pytest.raises(ValueError, match="overrides"):
            cpu_ops().sample(logits, md.temperature, None, None, None, md.uniforms, bad)


# ---------------------------------------------------------------------------------------------
# Greedy and edge cases


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


# ---------------------------------------------------------------------------------------------
# Penalties from kept counts


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


# ---------------------------------------------------------------------------------------------
# Seeded rows


def test_seeded_uniform_is_a_fixed_function_of_the_seed():
    # Pinned: a change of the noise source (which changes every seeded output) shows here.
    assert [seeded_uniform(position_seed(s, 0)) for s in (0, 1)] == pytest.approx(
        [0.7673286331466349, 0.05329355102889899], abs=1e-15)
    values = torch.tensor([seeded_uniform(position_seed(7, p)) for p in range(20_000)])
    assert 0.0 <= float(values.min()) and float(values.max()) < 1.0
    assert abs(float(values.mean()) - 0.5) < 0.01


def test_seeded_row_independent_of_batch():
    logits = torch.randn(1, 50)
    for seed in range(20):
        s = position_seed(seed, 0)
        alone, _ = Sampler()(logits.clone(), metadata(1, seeds={0: s}))
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
    seeds = {row: position_seed(row, 0) for row in range(NUM_DRAWS)}
    tokens, _ = Sampler()(LOGITS12.expand(NUM_DRAWS, -1).clone(), metadata(NUM_DRAWS, seeds=seeds))
    assert_follows(torch.tensor(tokens), reference_probs(LOGITS12))


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

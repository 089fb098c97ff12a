"""The Sampler on synthetic logits, through both implementations (the CPU kernel and the batched
torch ops used on GPU): distributions against a plain-torch reference (full sort, softmax,
multinomial) by a chi-square test, in every mode and combination, and the two paths against
each other. The fixture and helpers here serve the test_sampler_*.py files: filters' edge
cases, penalties, seeded rows and logprobs."""

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
    row_uniforms,
    sample_rows,
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

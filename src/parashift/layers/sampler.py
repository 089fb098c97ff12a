"""Batched sampling: penalties, then per row temperature, min-p, top-k, top-p and one draw.

The filters are thresholds on the row's scaled logits z = (logit - max) / temperature (vLLM's
definitions: min-p keeps probabilities >= min_p x the largest; top-k keeps the k largest, ties
at the k-th value all kept; top-p keeps the most likely tokens until the mass before the next
reaches top_p, ties at that boundary all kept), and one uniform number per row picks the token
by the inverse CDF over the kept tokens in vocabulary order. So a row costs passes over its
logits and work on what survives: no sort of the vocabulary, no random number per token.

On CPU the compiled kernel (kernels/cpu/sampling.cpp) does it all in one call; elsewhere
`sample_rows` does the same in batched torch ops. A seeded row's uniform comes from
(seed, output position) alone, so its tokens depend on nothing else in the batch and survive
preemption and recomputation unchanged; other rows draw theirs from torch's generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parashift.layers.host_to_device import to_device
from parashift.layers.kernel_dispatch import cpu_ops, on_cpu_kernels
from parashift.layers.penalties import PenaltyInputs, apply_penalties, penalized_values
from parashift.types.outputs import TokenLogprobs

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_ZERO_BELOW = -87.0  # a weight exp(z) below this is 0 (as the kernel has it)
_NUCLEUS_CANDIDATES = 1024  # top-p first looks for its tokens among this many largest


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [num_rows] float32, 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None  # [num_rows] int64, 0 where unused
    top_p: torch.Tensor | None  # [num_rows] float32, 1.0 where unused
    min_p: torch.Tensor | None  # [num_rows] float32, 0.0 where unused
    uniforms: torch.Tensor | None  # [num_rows] float64 in [0, 1); None when all greedy
    penalties: PenaltyInputs | None  # None when no row uses any
    num_logprobs: list[int | None]  # per row: None (not requested) or the top-k count


def position_seed(seed: int, position: int) -> int:
    return (seed + (position + 1) * _GOLDEN) & 0x7FFF_FFFF_FFFF_FFFF


def seeded_uniform(seed: int) -> float:
    """A uniform number in [0, 1) from a 64-bit seed (SplitMix64's finalizer, 53 bits)."""
    z = (seed + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def row_uniforms(num_rows: int, seeds: dict[int, int], device: torch.device) -> torch.Tensor:
    """One uniform per row: from `seeds` (row -> position seed) where given, else torch's RNG."""
    uniforms = torch.rand(num_rows, dtype=torch.float64)
    for row, seed in seeds.items():
        uniforms[row] = seeded_uniform(seed)
    return to_device(uniforms.numpy(), device)


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """[num_rows, vocab] logits -> one token id per row (+ logprobs where asked). The
        logits are left as they are."""
        tokens, logprobs = self.sample(logits, md)
        return tokens.tolist(), logprobs

    def sample(self, logits: torch.Tensor, md: SamplingMetadata
               ) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
        """As `__call__`, the ids left where the logits are (no wait for the device unless
        logprobs are asked)."""
        raw_logprobs = None
        if any(n is not None for n in md.num_logprobs):
            raw_logprobs = logits.float().log_softmax(dim=-1)
        p = md.penalties
        if on_cpu_kernels(logits) and logits.stride(-1) == 1:
            if md.all_greedy and p is None and logits.is_contiguous():
                tokens = cpu_ops().argmax(logits)
            else:  # penalized logits as overrides: the kernel copies a row only where needed
                overrides = (None if p is None else
                             (p.row_starts, p.token_ids, penalized_values(logits, p)))
                tokens = cpu_ops().sample(logits, md.temperature, md.top_k, md.top_p,
                                          md.min_p, md.uniforms, overrides)
            return tokens, self._logprobs(raw_logprobs, tokens, md)
        if p is not None:
            logits = logits.to(torch.float32, copy=True)
            apply_penalties(logits, p)
        if md.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sample_rows(logits, md.temperature, md.top_k, md.top_p, md.min_p,
                                 md.uniforms)
        return tokens, self._logprobs(raw_logprobs, tokens, md)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: torch.Tensor, md: SamplingMetadata
                  ) -> list[TokenLogprobs | None]:
        if raw is None:
            return [None] * len(md.num_logprobs)
        tokens = tokens.to(raw.device)
        k = max(n or 0 for n in md.num_logprobs)
        chosen = raw.gather(1, tokens.unsqueeze(1))
        ranks = (raw > chosen).sum(dim=-1).add_(1).tolist()
        top_vals, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], tokens[:, None][:, :0])
        chosen, top_vals, top_ids = chosen.squeeze(1).tolist(), top_vals.tolist(), top_ids.tolist()
        token_list = tokens.tolist()
        out: list[TokenLogprobs | None] = []
        for i, n in enumerate(md.num_logprobs):
            if n is None:
                out.append(None)
                continue
            out.append(TokenLogprobs([token_list[i]] + top_ids[i][:n],
                                     [chosen[i]] + top_vals[i][:n], ranks[i]))
        return out


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                uniforms: torch.Tensor) -> torch.Tensor:
    """The CPU kernel's sampling in batched torch ops (any device): [rows, vocab] -> [rows]."""
    x = logits.float()
    vocab = x.shape[-1]
    top = x.max(dim=-1, keepdim=True).values
    scale = 1.0 / temperature.unsqueeze(1)
    greedy = ((temperature <= 0) | ~scale.squeeze(1).isfinite() | ~top.squeeze(1).isfinite())
    scale = torch.where(greedy.unsqueeze(1), 1.0, scale)
    z = (x - torch.where(top.isfinite(), top, 0.0)) * scale  # [rows, vocab]
    floor = torch.full_like(temperature, _ZERO_BELOW)
    if min_p is not None:
        floor = torch.maximum(floor, min_p.log())
    if top_k is not None:
        active = (top_k > 0) & (top_k < vocab)
        k = torch.where(active, top_k, 1)
        kth = x.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        z_kth = ((kth - top) * scale).squeeze(1)
        floor = torch.where(active, torch.maximum(floor, z_kth), floor)
    weights = torch.where(z >= floor.unsqueeze(1), z.exp(), 0.0)
    if top_p is not None:
        nucleus = _nucleus_floor(weights, top_p)
        weights = torch.where((top_p < 1).unsqueeze(1) & (weights < nucleus.unsqueeze(1)), 0.0,
                              weights)
    cdf = weights.double().cumsum(dim=-1)
    target = (uniforms.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)
    return torch.where(greedy, x.argmax(dim=-1), drawn)


def _nucleus_floor(weights: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest weight top-p keeps: in descending order a token is kept while the
    mass before it is below top_p of the total. Looked for among the largest candidates first;
    rows whose candidates cannot hold the mass sort every token."""
    need = top_p.double() * weights.double().sum(dim=-1)
    floors = torch.zeros_like(top_p)
    rows = torch.arange(weights.shape[0], device=weights.device)
    for count in (min(_NUCLEUS_CANDIDATES, weights.shape[-1]), weights.shape[-1]):
        values = weights[rows].topk(count, dim=-1).values  # descending
        cum = values.double().cumsum(dim=-1)
        kept = ((cum - values) < need[rows].unsqueeze(1)).sum(dim=-1).clamp_(min=1)
        floors[rows] = values.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
        short = (cum[:, -1] < need[rows]) & (count < weights.shape[-1])
        rows = rows[short]
        if rows.numel() == 0:
            break
    return floors

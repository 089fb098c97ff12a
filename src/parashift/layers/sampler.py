"""Batched sampling: penalties, temperature, min-p, top-k, top-p, then one draw per row.

Random rows draw with the exponential-race trick (argmax of probs / Exp(1) noise), which is
exactly a sample from probs. A seeded row draws its noise from a generator seeded with
(seed, output position), so its tokens depend on nothing else in the batch and survive
preemption and recomputation unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parashift.layers.kernel_dispatch import cpu_ops, on_cpu_kernels
from parashift.types.outputs import TokenLogprobs

_GOLDEN = 0x9E3779B97F4A7C15


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [num_rows] float32, 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None  # [num_rows] int64, vocab size where unused
    top_p: torch.Tensor | None  # [num_rows] float32, 1.0 where unused
    min_p: torch.Tensor | None  # [num_rows] float32, 0.0 where unused
    seeds: dict[int, int]  # row -> per-position seed for seeded random rows
    # Penalties: None when no row uses any.
    presence_penalty: torch.Tensor | None  # [num_rows]
    frequency_penalty: torch.Tensor | None
    repetition_penalty: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None  # [num_rows, max_prompt] padded with vocab_size
    output_token_ids: torch.Tensor | None  # [num_rows, max_output] padded with vocab_size
    num_logprobs: list[int | None]  # per row: None (not requested) or the top-k count


def position_seed(seed: int, position: int) -> int:
    return (seed + (position + 1) * _GOLDEN) & 0x7FFF_FFFF_FFFF_FFFF


def _token_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, n] padded ids -> [rows, vocab] counts"""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int32,
                         device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    vocab = logits.shape[-1]
    output_counts = _token_mask(md.output_token_ids, vocab)
    seen = (output_counts > 0) | (_token_mask(md.prompt_token_ids, vocab) > 0)
    rep = md.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty.unsqueeze(1) * output_counts
    return logits - md.presence_penalty.unsqueeze(1) * (output_counts > 0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[-1] - top_k).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, -float("inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """[num_rows, vocab] logits -> one token id per row (+ logprobs where asked)."""
        wants_logprobs = any(n is not None for n in md.num_logprobs)
        if (md.all_greedy and md.repetition_penalty is None and not wants_logprobs
                and on_cpu_kernels(logits) and logits.is_contiguous()):
            return cpu_ops().argmax(logits).tolist(), [None] * len(md.num_logprobs)
        logits = logits.float()
        raw_logprobs = None
        if wants_logprobs:
            raw_logprobs = logits.log_softmax(dim=-1)
        if md.repetition_penalty is not None:
            logits = apply_penalties(logits, md)
        tokens = logits.argmax(dim=-1)
        if not md.all_greedy:
            tokens = torch.where(md.temperature == 0, tokens, self._sample(logits, md))
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw_logprobs, tokens, md)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        temperature = torch.where(md.temperature == 0, 1.0, md.temperature)
        logits = logits / temperature.unsqueeze(1)
        if md.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = md.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, -float("inf"))
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, seed in md.seeds.items():
            generator = torch.Generator(device=probs.device).manual_seed(seed)
            noise[row].exponential_(generator=generator)
        return probs.div_(noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: torch.Tensor, md: SamplingMetadata
                  ) -> list[TokenLogprobs | None]:
        if raw is None:
            return [None] * len(md.num_logprobs)
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

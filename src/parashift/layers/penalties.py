"""Repetition, frequency and presence penalties from per-request token counts.

A request's counts are kept across steps (one new token a step is a dict lookup), and a step
touches only the tokens its penalized rows have seen, never a [rows, vocab] count tensor."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from parashift.layers.host_to_device import to_device
from parashift.types.token_counts import TokenCounts


@dataclass
class PenaltyInputs:
    """The seen (row, token) pairs of a step's penalized rows, and every row's penalties."""

    rows: torch.Tensor  # [pairs] int64, ascending
    row_starts: torch.Tensor  # [num_rows + 1] int64: row r's pairs are [starts[r], starts[r+1])
    token_ids: torch.Tensor  # [pairs] int64
    output_counts: torch.Tensor  # [pairs] float32
    repetition: torch.Tensor  # [num_rows] float32, 1.0 where unused
    frequency: torch.Tensor  # [num_rows] float32, 0.0 where unused
    presence: torch.Tensor  # [num_rows] float32, 0.0 where unused

    @classmethod
    def gather(cls, counts: list[TokenCounts | None], repetition: list[float],
               frequency: list[float], presence: list[float],
               device: torch.device) -> PenaltyInputs:
        """`counts`: per row, the request's counts (None for a row without penalties)."""
        used = [(row, c) for row, c in enumerate(counts) if c is not None]
        sizes = [len(c.token_ids) for _, c in used]
        rows = np.repeat(np.array([row for row, _ in used], dtype=np.int64), sizes)
        row_starts = np.zeros(len(counts) + 1, dtype=np.int64)
        row_starts[[row + 1 for row, _ in used]] = sizes
        np.cumsum(row_starts, out=row_starts)
        token_ids = np.concatenate([c.token_ids for _, c in used]) if used else rows
        output_counts = (np.concatenate([c.output_counts for _, c in used]) if used
                         else np.zeros(0, np.float32))

        def column(values: list[float]) -> torch.Tensor:
            return to_device(np.array(values, dtype=np.float32), device)

        return cls(to_device(rows, device), to_device(row_starts, device),
                   to_device(token_ids, device), to_device(output_counts, device),
                   column(repetition), column(frequency), column(presence))


def penalized_values(logits: torch.Tensor, p: PenaltyInputs) -> torch.Tensor:
    """[pairs] float32: the seen tokens' logits after their penalties. Repetition (vLLM's, from
    CTRL) divides a seen token's positive logit and multiplies a negative one, prompt tokens
    included; frequency and presence (OpenAI's) subtract count * frequency + (count > 0) *
    presence, outputs only."""
    values = logits[p.rows, p.token_ids].float()
    rep = p.repetition[p.rows]
    values = torch.where(values > 0, values / rep, values * rep)
    values -= p.frequency[p.rows] * p.output_counts
    return values - p.presence[p.rows] * (p.output_counts > 0)


def apply_penalties(logits: torch.Tensor, p: PenaltyInputs) -> None:
    """In place on float logits [num_rows, vocab] (penalized_values written back)."""
    logits[p.rows, p.token_ids] = penalized_values(logits, p)

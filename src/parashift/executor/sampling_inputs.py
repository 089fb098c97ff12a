"""The sampler's view of a step's sampling rows, read from the input batch's columns
(executor/input_batch.py): a filter's column only where a sampled row uses it, the seeded
rows' draws from (seed, output position), the penalized rows' token counts."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from parashift.executor.input_batch import InputBatch
from parashift.layers.host_to_device import to_device
from parashift.layers.penalties import PenaltyInputs
from parashift.layers.sampler import SamplingMetadata, position_seed, row_uniforms


def sampling_metadata(batch: InputBatch, rows: np.ndarray, vocab_size: int,
                      device: torch.device, reuse: SamplingMetadata | None = None
                      ) -> SamplingMetadata:
    """The sampler's view of a step's sampling rows, from the batch's columns. `reuse`: the
    same rows' metadata of an earlier step, no request having come or gone since: only the
    draws and the penalty counts are made again."""
    md = reuse if reuse is not None else _columns(batch, rows, vocab_size, device)
    uniforms = None if md.all_greedy else row_uniforms(len(rows), row_seeds(batch, rows), device)
    penalties = penalty_inputs(batch, rows, device)
    if uniforms is None and penalties is None and md.penalties is None:
        return md
    return dataclasses.replace(md, uniforms=uniforms, penalties=penalties)


def _columns(batch: InputBatch, rows: np.ndarray, vocab_size: int,
             device: torch.device) -> SamplingMetadata:
    temperature = batch.temperature[rows]
    sampled = temperature > 0.0
    all_greedy = not sampled.any()

    def column(values: np.ndarray, used: bool) -> torch.Tensor | None:
        # A filter's column exists only when a sampled row uses it: neutral values cost nothing.
        return to_device(values, device) if used else None

    top_k = batch.top_k[rows]
    top_p = batch.top_p[rows]
    min_p = batch.min_p[rows]
    num_logprobs: list[int | None] = [None] * len(rows)
    if batch.has_logprobs[rows].any():
        num_logprobs = [batch.params[r].logprobs for r in rows.tolist()]
    return SamplingMetadata(
        temperature=to_device(temperature, device),
        all_greedy=bool(all_greedy),
        top_k=column(top_k, bool(((top_k > 0) & (top_k < vocab_size)).any())),
        top_p=column(top_p, bool((top_p < 1.0).any())),
        min_p=column(min_p, bool((min_p > 0.0).any())),
        uniforms=None,
        penalties=None,
        num_logprobs=num_logprobs,
    )


def row_seeds(batch: InputBatch, rows: np.ndarray) -> dict[int, int]:
    """Seeded sampling rows -> their draw's seed, from (seed, output position)."""
    seeded = np.flatnonzero(batch.seeded[rows])
    if not len(seeded):
        return {}
    output_pos = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    return {i: position_seed(batch.params[rows[i]].seed, int(output_pos[i]))
            for i in seeded.tolist()}


def penalty_inputs(batch: InputBatch, rows: np.ndarray,
                   device: torch.device) -> PenaltyInputs | None:
    if not batch.num_penalized or not batch.penalized[rows].any():
        return None
    params = [batch.params[r] for r in rows.tolist()]
    return PenaltyInputs.gather(
        [batch.counts[r] for r in rows.tolist()], [p.repetition_penalty for p in params],
        [p.frequency_penalty for p in params], [p.presence_penalty for p in params], device)

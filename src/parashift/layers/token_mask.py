"""Structured outputs in the model runner: the rows of a step's logits whose grammar allows
only some tokens next get -inf elsewhere, before the sampler (so sampling, and the logprobs
it reports, are of the masked distribution). The bitmask comes with the step, filled by the
engine core (engine/structured_output.py): one int32 word per 32 tokens."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int | None], bits: bytes,
                        words: int) -> None:
    """In place: logits[rows[i]] keeps the tokens set in row i of `bits` ([len(rows), words]
    int32 words), -inf elsewhere (columns past the bitmask's, if any, too); a row None is
    skipped (its request does not sample here)."""
    masks = torch.frombuffer(bytearray(bits), dtype=torch.int32).view(len(rows), words)
    kept = [i for i, row in enumerate(rows) if row is not None]
    if not kept:
        return
    if len(kept) < len(rows):
        masks, rows = masks[kept], [rows[i] for i in kept]
    allowed = ((masks.unsqueeze(-1) >> _BITS) & 1).bool().view(len(rows), words * 32)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = torch.tensor(rows, device=logits.device)
    selected = logits.index_select(0, index)
    selected.masked_fill_(~allowed[:, :vocab].to(logits.device), float("-inf"))
    logits.index_copy_(0, index, selected)

"""Structured outputs in the model runner: the rows of a step's logits whose grammar allows
only some tokens next get -inf elsewhere, before the sampler (so sampling, and the logprobs
it reports, are of the masked distribution). The bitmask comes with the step, filled by the
engine core (engine/structured_output.py): one int32 word per 32 tokens, bit t of word t // 32
(little-endian bytes, so numpy's little-order unpacking reads token order)."""

from __future__ import annotations

import numpy as np
import torch

from parashift.layers.host_to_device import to_device


def apply_token_bitmask(logits: torch.Tensor, rows: list[int | None], bits: bytes,
                        words: int) -> None:
    """In place: logits[rows[i]] keeps the tokens set in row i of `bits` ([len(rows), words]
    int32 words), -inf elsewhere (columns past the bitmask's, if any, too); a row None is
    skipped (its request does not sample here)."""
    allowed = np.unpackbits(np.frombuffer(bits, dtype=np.uint8).reshape(len(rows), words * 4),
                            axis=1, bitorder="little").view(bool)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    kept = [(i, row) for i, row in enumerate(rows) if row is not None]
    if not kept:
        return
    masks, targets = zip(*kept, strict=True)
    blocked = to_device(~allowed[list(masks), :vocab], logits.device)
    index = to_device(np.array(targets, dtype=np.int64), logits.device)
    logits[index] = logits[index].masked_fill(blocked, float("-inf"))  # one op for all rows

"""What the kernels read through raw pointers, checked before a call: a wrong shape, dtype or
stride there is no exception but a read past the end of a buffer."""

from __future__ import annotations

import torch


def check_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, weight_dtype: torch.dtype,
               *vectors: torch.Tensor | None) -> None:
    """x [rows, k] bf16, the weight packed for n columns, and bias / scale vectors [n]."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D bfloat16 with contiguous rows, not {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    want = ((n + 15) // 16, x.shape[1] // 2, 32)
    if packed.dtype != weight_dtype or tuple(packed.shape) != want or not packed.is_contiguous():
        raise ValueError(f"packed weight must be {weight_dtype} {want} for x {tuple(x.shape)} "
                         f"and n={n}, not {packed.dtype} {tuple(packed.shape)}")
    for v in vectors:
        if v is not None and (v.dtype != torch.bfloat16 or tuple(v.shape) != (n,)
                              or not v.is_contiguous()):
            raise ValueError(f"bias and scale must be contiguous bfloat16 [{n}], not {v.dtype} "
                             f"{tuple(v.shape)}")


def check_sampling(logits: torch.Tensor,
                   columns: tuple[tuple[torch.Tensor | None, torch.dtype], ...],
                   overrides: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
    """The sampler's logits [rows, vocab], its per-row columns (each with its dtype; None:
    unused) and the penalized logits' overrides (CpuOps.sample)."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1 or logits.stride(0) < vocab:
        raise ValueError(f"logits rows must be contiguous, not strides {logits.stride()}")
    for column, dtype in columns:
        if column is not None and (column.dtype != dtype or tuple(column.shape) != (rows,)
                                   or not column.is_contiguous()):
            raise ValueError(f"sampling columns must be contiguous {dtype} [{rows}], not "
                             f"{column.dtype} {tuple(column.shape)}")
    if overrides is None:
        return
    starts, ids, values = overrides
    n = ids.numel()
    if (starts.dtype != torch.int64 or tuple(starts.shape) != (rows + 1,)
            or ids.dtype != torch.int64 or values.dtype != torch.float32
            or values.numel() != n or not (starts.is_contiguous() and ids.is_contiguous()
                                           and values.is_contiguous())
            or int(starts[0]) != 0 or int(starts[-1]) != n
            or bool((starts.diff() < 0).any())
            or (n and not 0 <= int(ids.min()) <= int(ids.max()) < vocab)):
        raise ValueError("overrides must be contiguous (starts int64 [rows + 1] from 0 "
                         "to their count, ids int64 below the vocabulary, values "
                         "float32)")

"""The GEMM under every linear layer and the LM head: one class per path, each holding the
weight as its path keeps it and running its GEMM, x [..., in] -> [..., out] in x's dtype.

- `Gemm`: `F.linear` on the module's weight as loaded (oneDNN/MKL behind torch; every path
  on CUDA);
- `OneDnnGemm`: the weight reordered once into oneDNN's blocked layout for this CPU
  (`mkldnn::_linear_pointwise`), fp32 or half; F.linear reorders on every call instead;
- `OwnBf16Gemm`: a bf16 weight packed for parashift's own kernel (kernels/cpu/gemm.cpp);
- `QuantizedGemm` (layers/quantization.py): an int8 or int4 weight;
- `RowGemm` (--deterministic, where our kernel does not take the weight): `F.linear` one row
  at a time, through buffers of their own, so that each row meets the same call whatever the
  row count (a BLAS picks its kernel, blocking and threads by the shape, and its vector loops
  by the addresses).

Every path keeps one copy of the weight, in the model's dtype: a prepared path takes the
place of the module's plain weight, which becomes a meta tensor (its shape and dtype stay), so
the bytes a model keeps do not depend on which path wins the timing and `plan` predicts them
before anything is loaded. Only a weight that another module also reads (an LM head tied to
the embedding) keeps its plain copy beside the prepared one. (MKL's packed layout is not a
path: its buffer measured 4x the weight for a 960x576 fp32 matrix, in bytes nothing predicts.)
Which path each weight takes on a CPU is layers/gemm_paths.py's choice, made at load."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from parashift.layers.kernel_dispatch import cpu_ops


class Gemm:
    """`F.linear` on the weight as it is. Subclasses keep a prepared copy and run their own
    GEMM in `_apply`; activations go in and come out in the caller's dtype."""

    kind: ClassVar[str] = "linear"
    reads_plain_weight: ClassVar[bool] = True  # False: a prepared copy replaces it

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # the module's parameter (its dtype sets the GEMM's)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = self.weight
        xw = x.to(w.dtype) if w.dtype != x.dtype else x
        y = self._apply(xw, bias)
        return y.to(x.dtype) if y.dtype != x.dtype else y

    def _apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    @property
    def read_bytes(self) -> int:
        """Bytes one GEMM streams: the weight as the kernel reads it."""
        return self.weight.numel() * self.weight.element_size()

    @property
    def kept_bytes(self) -> int:
        """Bytes this GEMM holds beside the module's parameters: its prepared copy, counted
        at the weight's size (a layout's padding, under one block of rows, left out)."""
        return 0 if self.reads_plain_weight else self.read_bytes


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN GEMM runs at: oneDNN builds and caches a kernel per shape, and
    with every step's token count its own, the cache (and the resident memory) kept growing.
    Bucketed, a server meets a bounded set: exact to 32 rows (decode batches), then 16 buckets
    per octave, so at most 1/16 of the rows are padding."""
    if rows <= 32:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


class OneDnnGemm(Gemm):
    kind = "onednn"
    reads_plain_weight = False

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)

    def _apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Called for every GEMM of every step: no tensor op that the common 2-D case can skip.
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rows = flat.shape[0]
        padded = onednn_rows(rows)
        if padded != rows:
            flat = F.pad(flat, (0, 0, 0, padded - rows))
        elif not flat.is_contiguous():
            flat = flat.contiguous()
        y = torch.ops.mkldnn._linear_pointwise(flat, self.packed, bias, "none", [], "")
        if padded != rows:
            y = y[:rows]
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


class OwnBf16Gemm(Gemm):
    """A bf16 weight packed for our kernel, which runs every row count."""

    kind = "own-bf16"
    reads_plain_weight = False

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.packed = cpu_ops().pack_bf16(weight)

    def _apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        y = cpu_ops().gemm_bf16(flat, self.packed, self.weight.shape[0], bias)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


class RowGemm(Gemm):
    kind = "rows"

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        self.row_in = torch.empty(1, weight.shape[1], dtype=weight.dtype)
        self.row_out = torch.empty(1, weight.shape[0], dtype=weight.dtype)

    def _apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = torch.empty(flat.shape[0], self.weight.shape[0], dtype=flat.dtype)
        for i in range(flat.shape[0]):
            self.row_in.copy_(flat[i])
            torch.mm(self.row_in, self.weight.t(), out=self.row_out)
            y[i] = self.row_out[0]
        if bias is not None:
            y += bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


PATHS: dict[str, type[Gemm]] = {cls.kind: cls for cls in (Gemm, OneDnnGemm, OwnBf16Gemm, RowGemm)}


def gemm_for_path(weight: torch.Tensor, path: str) -> Gemm:
    """The GEMM of `weight` on `path` (a name layers/gemm_paths.py chooses among)."""
    return PATHS[path](weight)

"""The GEMM under every linear layer and the LM head, and how weights are prepared for it.

On CPU each GEMM weight takes the path that measured fastest for its dtype and shape on this
CPU (layers/gemm_paths.py: F.linear as it is, MKL's packed fp32 layout, oneDNN's reordered
layout, our own bf16 kernel's layout, or a half-precision weight widened to fp32 once, then one
of those), timed at load time and cached per CPU model.
The widened and packed copies trade weight memory (up to 4x a bf16 checkpoint) for speed;
CUDA is untouched."""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F
from torch import nn

from parashift.layers.gemm_paths import GemmPaths, OwnBf16Weight, prepare
from parashift.layers.kernel_dispatch import cpu_ops
from parashift.layers.quantization import QuantizedWeight, quantize, quantized_linear


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN GEMM runs at: oneDNN builds and caches a kernel per shape, and
    with every step's token count its own, the cache (and the resident memory) kept growing
    (+250 MiB per engine over a 5,000-request soak). Bucketed, a server meets a bounded set:
    exact to 32 rows (decode batches), then 16 buckets per octave, so at most 1/16 of the
    rows are padding (fixed steps of 16 and 128 had padded 17 decodes to 32, a 300-row prefill by
    28%)."""
    if rows <= 32:
        return rows
    step = 1 << (rows.bit_length() - 5)
    return -(-rows // step) * step


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    # Called for every GEMM of every step: no tensor op that the common 2-D case can skip.
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    padded = onednn_rows(rows)
    if padded != rows:
        flat = F.pad(flat, (0, 0, 0, padded - rows))
    elif not flat.is_contiguous():
        flat = flat.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    if padded != rows:
        y = y[:rows]
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def _own_bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     own: OwnBf16Weight) -> torch.Tensor:
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if flat.shape[0] > own.max_rows:  # a big prefill: F.linear measured faster there
        return F.linear(x, weight, bias)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    y = cpu_ops().gemm_bf16(flat, own.packed, weight.shape[0], bias)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | OwnBf16Weight | QuantizedWeight | None = None
           ) -> torch.Tensor:
    """x: [num_tokens, in] -> [num_tokens, out], in x's dtype."""
    if isinstance(packed, QuantizedWeight):  # the float weight is gone
        return quantized_linear(x, packed, bias)
    xw = x.to(weight.dtype) if weight.dtype != x.dtype else x
    if isinstance(packed, OwnBf16Weight):
        y = _own_bf16_linear(xw, weight, bias, packed)
    elif packed is not None and packed.shape == weight.shape:  # oneDNN's layout keeps the shape
        y = _onednn_linear(xw, packed, bias)
    elif packed is not None:  # MKL's: one flat buffer
        # The packed layout does not depend on the row count, which must be passed as is.
        y = torch.ops.mkl._mkl_linear(xw, packed, weight, bias, xw.shape[0])
    else:
        y = F.linear(xw, weight, bias)
    return y.to(x.dtype) if y.dtype != x.dtype else y


def gemm_weight_bytes(module: nn.Module) -> int:
    """Bytes a GEMM module's weight takes as its GEMM reads it (quantized or not)."""
    if isinstance(module.packed_weight, QuantizedWeight):
        return module.packed_weight.nbytes
    return module.weight.numel() * module.weight.element_size()


def prepare_gemm_weights(model: nn.Module, device: torch.device,
                         quantization: str | None = None) -> list[str]:
    """Give every module with a `packed_weight` slot the GEMM path chosen for its weight on
    this CPU, or its quantized weight (`quantization`, what layers/quantization.py names).
    Returns what was done, for the load log."""
    if device.type != "cpu":
        return []
    notes = quantize_weights(model, quantization) if quantization else []
    paths = GemmPaths()
    counts: dict[str, int] = {}
    limits: dict[str, int] = {}  # our own kernel's most rows -> how many weights
    for m in model.modules():
        if not hasattr(m, "packed_weight") or isinstance(m.packed_weight, QuantizedWeight):
            continue
        path = paths.choose(m.weight.dtype, *m.weight.shape)
        weight, m.packed_weight = prepare(m.weight.data, path)
        if isinstance(m.packed_weight, OwnBf16Weight):
            limit = paths.row_limit(m.weight.dtype, *m.weight.shape)
            m.packed_weight = dataclasses.replace(m.packed_weight, max_rows=limit)
            label = "any" if limit == sys.maxsize else str(limit)
            limits[label] = limits.get(label, 0) + 1
        if weight.dtype != m.weight.dtype:  # widened: the bias goes along
            m.weight.data = weight
            if getattr(m, "bias", None) is not None:
                m.bias.data = m.bias.data.float()
        counts[path] = counts.get(path, 0) + 1
    paths.save()
    timed = f" ({len(paths.timed)} timings now)" if paths.timed else ""
    above = ("; own-bf16 up to " + ", ".join(f"{label} rows ({n})" for label, n in limits.items())
             + ", F.linear above" if limits else "")
    return [*notes, f"GEMM paths on this CPU{timed}: "
            + ", ".join(f"{n} {path}" for path, n in sorted(counts.items())) + above]


def quantize_weights(model: nn.Module, method: str) -> list[str]:
    """The decoder layers' linear weights -> `method`, the float weights dropped (see
    layers/quantization.py for what stays as it is)."""
    from parashift.layers.linear import ColumnParallelLinear, RowParallelLinear

    before = after = count = 0
    for m in model.modules():
        if not isinstance(m, ColumnParallelLinear | RowParallelLinear):
            continue
        m.packed_weight = quantize(m.weight.data, method)
        before += m.weight.numel() * m.weight.element_size()
        after += m.packed_weight.nbytes
        # the float weight's shape and dtype stay, on no memory
        m.weight = nn.Parameter(m.weight.to("meta"), requires_grad=False)
        count += 1
    return [f"{method} weights: {count} linear layers, {before / 2**20:.1f} MiB -> "
            f"{after / 2**20:.1f} MiB"]

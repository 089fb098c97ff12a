"""RMSNorm, optionally fused with the residual add that precedes it: one pass over each row.

Rounds as the torch layer does: the sum x + residual in the activation dtype, the
normalisation in float32, cast back, then the weight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride,
                     residual_stride, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * residual_stride + offs, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * rstd).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offs, mask=mask)
    tl.store(out_ptr + row * N + offs, y * weight, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden] (rows contiguous). Without residual: the normed x;
    with it: (norm(x + residual), x + residual)."""
    assert x.stride(-1) == 1 and x.dim() == 2
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, residual_out, x.stride(0),
            residual.stride(0) if residual is not None else 0, eps, N=hidden,
            BLOCK=triton.next_power_of_2(hidden), HAS_RESIDUAL=residual is not None)
    return out if residual is None else (out, residual_out)


def rms_norm_reference(x, weight, eps, residual=None):
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if residual is None else (y, x)

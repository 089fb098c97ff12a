from __future__ import annotations

import torch
from torch import nn

from parashift.layers.kernel_dispatch import cpu_ops, on_cpu_kernels, on_kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like the reference implementations. With `residual` it
    first adds it (fused add + norm) and returns the sum as the new residual."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if on_kernels(x) and x.dim() == 2 and x.stride(-1) == 1 and (
                residual is None or residual.stride(-1) == 1):
            from parashift.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)  # one pass, add fused
        if on_cpu_kernels(x) and x.dim() == 2 and x.stride(-1) == 1 and (
                self.weight.dtype == x.dtype) and (
                residual is None or (residual.dim() == 2 and residual.stride(-1) == 1)):
            return cpu_ops().rms_norm(x, self.weight, self.eps, residual)  # the same, on CPU
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

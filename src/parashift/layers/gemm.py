"""The GEMM under every linear layer and the LM head, and how weights are prepared for it.

On CPU two load-time preparations pay off (measured in docs/BENCHMARKS.md):
- without bf16 dot-product instructions (no avx512_bf16/amx_bf16) a bf16 GEMM runs an
  emulated path ~5x slower than fp32, so bf16 GEMM weights are widened to fp32 once. The
  values stay exactly the bf16 ones and activations and the KV cache stay bf16: each GEMM
  rounds its fp32-accumulated result to bf16, the numerics of a native bf16 kernel.
- fp32 weights get a copy in MKL's packed GEMM layout (as Intel's extension for PyTorch
  does): 2-3.5x faster for the skinny decode GEMMs, never slower for big prefill ones.
Both trade weight memory (up to 4x a bf16 checkpoint) for speed; CUDA is untouched."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x: [num_tokens, in] -> [num_tokens, out], in x's dtype."""
    xw = x.to(weight.dtype) if weight.dtype != x.dtype else x
    if packed is not None:
        # The packed layout does not depend on the row count, which must be passed as is.
        y = torch.ops.mkl._mkl_linear(xw, packed, weight, bias, xw.shape[0])
    else:
        y = F.linear(xw, weight, bias)
    return y.to(x.dtype) if y.dtype != x.dtype else y


def _can_pack() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def prepare_gemm_weights(model: nn.Module, device: torch.device) -> list[str]:
    """Apply the CPU preparations above to every module with a `packed_weight` slot.
    Returns what was done, for the load log."""
    if device.type != "cpu":
        return []
    done = []
    modules = [m for m in model.modules() if hasattr(m, "packed_weight")]
    if not cpu_has_native_bf16() and any(m.weight.dtype == torch.bfloat16 for m in modules):
        for m in modules:
            for param in m.parameters(recurse=False):
                if param.dtype == torch.bfloat16:
                    param.data = param.data.float()
        done.append("bf16 GEMM weights widened to fp32 (no native bf16 on this CPU)")
    if _can_pack():
        packed = 0
        for m in modules:
            if m.weight.dtype == torch.float32:
                m.packed_weight = torch.ops.mkl._mkl_reorder_linear_weight(m.weight.data, 64)
                packed += 1
        if packed:
            done.append(f"{packed} fp32 GEMM weights packed for MKL")
    return done

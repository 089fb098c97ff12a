"""Rotary position embedding (neox layout: the two halves of each head rotate together)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from parashift.layers.kernel_dispatch import cpu_ops, on_cpu_kernels, on_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """transformers 5 keeps rope settings in `rope_parameters`; older configs in
    `rope_theta` + `rope_scaling`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]):
        super().__init__()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32),
                            _inv_freq(head_dim, params))
        # [2, max_position, head_dim // 2]: cos, then sin
        self.register_buffer("cos_sin_cache", torch.stack([freqs.cos(), freqs.sin()]),
                             persistent=False)
        self._in_dtype: dict[torch.dtype, torch.Tensor] = {}  # the cache cast once per dtype

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Per-step tables, computed once and shared by every layer: [num_tokens, 1, d/2]
        each, from one gather (rounding to `dtype` before or after a gather is the same)."""
        cache = self._in_dtype.get(dtype)
        if cache is None or cache.device != self.cos_sin_cache.device:
            cache = self._in_dtype[dtype] = self.cos_sin_cache.to(dtype)
        cos, sin = cache.index_select(1, positions).unsqueeze(2)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]. On CUDA the Triton kernel, on CPU the compiled
    kernel, rotates x in place (x is a fresh projection output, or a view of one) and returns
    it."""
    if on_kernels(x) and x.stride(-1) == 1:
        from parashift.kernels.rotary import apply_rotary as rotate_in_place

        rotate_in_place(x, None, cos.view(cos.shape[0], cos.shape[-1]),
                        sin.view(sin.shape[0], sin.shape[-1]))
        return x
    if on_cpu_kernels(x) and x.stride(-1) == 1 and x.stride(1) == x.shape[2] and (
            cos.dtype == x.dtype):
        return cpu_ops().rotary_(x, cos.view(cos.shape[0], cos.shape[-1]),
                                 sin.view(sin.shape[0], sin.shape[-1]))
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

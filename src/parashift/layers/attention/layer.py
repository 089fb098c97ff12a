from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from parashift.layers.attention.backend import AttentionBackend


class Attention(nn.Module):
    """One layer's attention over its slice of the paged KV cache. The cache tensors are bound
    by the worker after allocation; metadata comes with every forward call."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: AttentionBackend):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any):
        assert self.kv_cache is not None, "KV cache not bound"
        if not torch.autograd._profiler_enabled():  # the label costs a few us per layer
            return self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale)
        with record_function("parashift::attention"):  # for `bench latency --breakdown`
            return self.backend.forward(q, k, v, self.kv_cache, metadata, self.scale)

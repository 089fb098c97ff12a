"""Qwen3: Llama with RMSNorm on each query and key head before the rotary embedding."""

from __future__ import annotations

from typing import Any

import torch

from parashift.distributed.parallel_context import ParallelContext
from parashift.layers.attention.backend import AttentionBackend
from parashift.models.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    def __init__(self, cfg: Any, dtype: torch.dtype, backend: AttentionBackend,
                 max_position: int, parallel: ParallelContext):
        bias = bool(getattr(cfg, "attention_bias", False))
        self.attn_flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}
        super().__init__(cfg, dtype, backend, max_position, parallel)

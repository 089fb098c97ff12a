"""The attention backend interface. A backend turns one step's batch description into its own
metadata (once per step) and then runs every layer's attention over the paged KV cache.

KV cache per layer: key and value tensors of shape [num_blocks, block_size, num_kv_heads,
head_dim]. The flat batch puts all decode requests (one query token each) first, then the
prefill chunks; `query_start_loc` delimits each request's tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionStepInputs:
    query_start_loc: np.ndarray  # [num_reqs + 1] token offsets into the flat batch
    seq_lens: np.ndarray  # [num_reqs] context length after this step
    num_computed_tokens: np.ndarray  # [num_reqs] context already in the cache before this step
    block_table: np.ndarray  # [num_reqs, max_blocks_per_req]
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    num_decodes: int  # the first num_decodes requests have exactly one query token
    block_size: int
    sliding_window: int | None
    device: torch.device


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def build_metadata(self, step: AttentionStepInputs) -> Any:
        """Once per step: precompute whatever every layer's attention call reuses."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: Any,
        scale: float,
    ) -> torch.Tensor:
        """Write the new keys/values into the cache, then attend. Returns
        [num_tokens, num_heads * head_dim]."""


# Resolved names (config.resolve_attention_backend picks one for "auto"); imported lazily.
_BACKENDS = {"torch": "parashift.layers.attention.torch_backend:TorchAttentionBackend",
             "cpu": "parashift.layers.attention.cpu_backend:CpuAttentionBackend",
             "triton": "parashift.layers.attention.triton_backend:TritonAttentionBackend"}


def get_attention_backend(name: str, deterministic: bool = False) -> AttentionBackend:
    """`deterministic` (the cpu backend only: config.check_deterministic): every query token
    attends the same way whatever the step holds."""
    import importlib

    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    backend = getattr(importlib.import_module(module), cls)
    return backend(deterministic=True) if deterministic else backend()

"""Attention over the paged KV cache in plain torch (CPU, and a GPU fallback).

Decode requests are batched into one SDPA call: their blocks are gathered (block-granular
index_select, far cheaper than per-slot gathers) and padded positions masked out. Grouped-query
attention is done without repeating K/V: the query heads that share a kv head become that kv
head's "query rows". Prefill chunks run one SDPA call each; a chunk with no cached prefix
attends to its own fresh K/V with `is_causal`, skipping the cache read.

The CPU backend (cpu_backend.py) is this one with its own metadata, `write_kv`, `decode` and
`prefill`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from parashift.layers.attention.backend import AttentionBackend, AttentionStepInputs


@dataclass
class _Prefill:
    start: int  # token range in the flat batch
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # None: no cached prefix, attend to the fresh K/V
    mask: torch.Tensor | None  # [num_query_tokens, seq_len] bool, None: plain causal


@dataclass
class _Decodes:
    block_ids: torch.Tensor  # [num_decodes * blocks_per_seq]
    padded_len: int  # padded context length of the decode batch
    mask: torch.Tensor | None  # [num_decodes, 1, 1, padded_len] bool, None: nothing masked


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    num_decodes: int
    decodes: Any  # what the backend's decode reads (here _Decodes); None without decodes
    prefills: list[_Prefill]


def _window_start(pos: np.ndarray, window: int | None) -> np.ndarray:
    return np.zeros_like(pos) if window is None else np.maximum(pos - window + 1, 0)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, step: AttentionStepInputs) -> TorchAttentionMetadata:
        decodes = self.decode_metadata(step) if step.num_decodes else None
        return TorchAttentionMetadata(step.slot_mapping, step.num_decodes, decodes,
                                      self._prefill_metadata(step))

    def decode_metadata(self, step: AttentionStepInputs) -> Any:
        bs, dev, nd = step.block_size, step.device, step.num_decodes
        seq_lens = step.seq_lens[:nd]
        num_blocks = int(-(-seq_lens.max() // bs))
        padded_len = num_blocks * bs
        block_ids = torch.from_numpy(
            np.ascontiguousarray(step.block_table[:nd, :num_blocks]).reshape(-1)).to(dev)
        key_pos = np.arange(padded_len)
        lo = _window_start(seq_lens - 1, step.sliding_window)
        valid = (key_pos[None, :] < seq_lens[:, None]) & (key_pos[None, :] >= lo[:, None])
        mask = None if valid.all() else torch.from_numpy(valid).to(dev).view(nd, 1, 1,
                                                                             padded_len)
        return _Decodes(block_ids, padded_len, mask)

    def _prefill_metadata(self, step: AttentionStepInputs) -> list[_Prefill]:
        bs, dev = step.block_size, step.device
        prefills = []
        for i in range(step.num_decodes, len(step.seq_lens)):
            start, end = int(step.query_start_loc[i]), int(step.query_start_loc[i + 1])
            seq_len, cached = int(step.seq_lens[i]), int(step.num_computed_tokens[i])
            block_ids = mask = None
            if cached:
                num_blocks = -(-seq_len // bs)
                block_ids = torch.from_numpy(step.block_table[i, :num_blocks].copy()).to(dev)
            windowed = step.sliding_window is not None and seq_len > step.sliding_window
            if cached or windowed:
                q_pos = np.arange(cached, seq_len)[:, None]
                k_pos = np.arange(seq_len)[None, :]
                allowed = (k_pos <= q_pos) & (k_pos >= _window_start(q_pos, step.sliding_window))
                mask = torch.from_numpy(allowed).to(dev)
            prefills.append(_Prefill(start, end, seq_len, block_ids, mask))
        return prefills

    def write_kv(self, key, value, kv_cache, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = kv_cache
        _, _, num_kv_heads, head_dim = key_cache.shape
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def decode(self, out, query, kv_cache, decodes: _Decodes, scale: float) -> None:
        """out [nd, heads, head_dim] <- the decode queries [nd, heads, head_dim] over the
        cache. One SDPA call: the query heads that share a kv head are its rows."""
        key_cache, value_cache = kv_cache
        _, _, num_kv_heads, head_dim = key_cache.shape
        nd, num_heads, _ = query.shape
        q = query.view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
        shape = (nd, decodes.padded_len, num_kv_heads, head_dim)
        k = key_cache.index_select(0, decodes.block_ids).view(shape).transpose(1, 2)
        v = value_cache.index_select(0, decodes.block_ids).view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=decodes.mask, scale=scale)
        out.copy_(o.reshape(nd, num_heads, head_dim))

    def forward(self, query, key, value, kv_cache, metadata: TorchAttentionMetadata, scale):
        # kv_cache: key and value, each [num_blocks, block_size, num_kv_heads, head_dim]
        num_tokens, num_heads, head_dim = query.shape
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        out = query.new_empty(num_tokens, num_heads, head_dim)
        nd = metadata.num_decodes
        if nd:
            self.decode(out[:nd], query[:nd], kv_cache, metadata.decodes, scale)
        if metadata.prefills:
            self.prefill(out, query, key, value, kv_cache, metadata, scale)
        return out.view(num_tokens, num_heads * head_dim)

    def prefill(self, out, query, key, value, kv_cache, metadata: TorchAttentionMetadata,
                scale: float) -> None:
        """out's prefill rows <- one SDPA call per prefill chunk."""
        key_cache, value_cache = kv_cache
        _, _, num_kv_heads, head_dim = key_cache.shape
        num_heads = query.shape[1]
        for p in metadata.prefills:
            q = query[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
            if p.block_ids is None:
                k, v = key[p.start : p.end], value[p.start : p.end]
            else:
                k = key_cache.index_select(0, p.block_ids).view(-1, num_kv_heads, head_dim)
                v = value_cache.index_select(0, p.block_ids).view(-1, num_kv_heads, head_dim)
                k, v = k[: p.seq_len], v[: p.seq_len]
            k = k.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, seq_len, head_dim]
            v = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )
            out[p.start : p.end] = o.squeeze(0).transpose(0, 1)

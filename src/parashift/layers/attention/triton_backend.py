"""Attention over the paged KV cache with the Triton kernels of `parashift.kernels` (the GPU
path; on CPU only under Triton's interpreter, for tests).

The step's metadata is a handful of int32 tensors built once: decodes (one query token each)
go to the split-K paged decode kernel, the prefill chunks (with or without a cached prefix)
to the varlen prefill kernel, and the new keys/values are written through `slot_mapping`
first. The tensors have fixed roles and shapes per batch size, so a captured CUDA graph can
replay them with new contents."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from parashift.layers.attention.backend import AttentionBackend, AttentionStepInputs
from parashift.layers.host_to_device import to_device


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    num_decodes: int
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int32
    max_decode_seq_len: int  # with the batch size, sets the split-K count
    prefill_block_table: torch.Tensor | None  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor | None  # [num_prefills + 1], from the first prefill
    prefill_seq_lens: torch.Tensor | None  # [num_prefills] int32
    max_prefill_query_len: int
    sliding_window: int | None


def _int32(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return to_device(np.ascontiguousarray(array, dtype=np.int32), device)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        # Imported here: the kernels' decorators read TRITON_INTERPRET when they run.
        from parashift.kernels import decode_attention, kv_cache_write, prefill_attention

        self._decode = decode_attention
        self._write = kv_cache_write.write_kv_cache
        self._prefill = prefill_attention.paged_prefill_attention
        self.num_sms = (torch.cuda.get_device_properties(0).multi_processor_count
                        if torch.cuda.is_available() else 132)

    def build_metadata(self, step: AttentionStepInputs) -> TritonAttentionMetadata:
        nd, dev, num_reqs = step.num_decodes, step.device, len(step.seq_lens)
        decode_table = decode_lens = None
        max_decode = 0
        if nd:
            seq_lens = step.seq_lens[:nd]
            num_blocks = int(-(-seq_lens.max() // step.block_size))
            decode_table = _int32(step.block_table[:nd, :num_blocks], dev)
            decode_lens = _int32(seq_lens, dev)
            max_decode = int(seq_lens.max())
        prefill_table = prefill_starts = prefill_lens = None
        max_q = 0
        if num_reqs > nd:
            starts = step.query_start_loc[nd:] - step.query_start_loc[nd]
            prefill_starts = _int32(starts, dev)
            prefill_lens = _int32(step.seq_lens[nd:], dev)
            num_blocks = int(-(-step.seq_lens[nd:].max() // step.block_size))
            prefill_table = _int32(step.block_table[nd:, :num_blocks], dev)
            max_q = int(np.diff(starts).max())
        return TritonAttentionMetadata(step.slot_mapping, nd, decode_table, decode_lens,
                                       max_decode, prefill_table, prefill_starts, prefill_lens,
                                       max_q, step.sliding_window)

    def forward(self, query, key, value, kv_cache, metadata: TritonAttentionMetadata, scale):
        key_cache, value_cache = kv_cache  # [num_blocks, block_size, num_kv_heads, head_dim]
        _, block_size, num_kv_heads, _ = key_cache.shape
        num_tokens, num_heads, head_dim = query.shape
        self._write(key, value, key_cache, value_cache, metadata.slot_mapping)
        out = query.new_empty(num_tokens, num_heads, head_dim)
        nd = metadata.num_decodes
        if nd:
            num_splits = self._decode.num_splits_for(nd, num_kv_heads,
                                                     metadata.max_decode_seq_len, block_size,
                                                     self.num_sms)
            self._decode.paged_decode_attention(
                query[:nd], key_cache, value_cache, metadata.decode_block_table,
                metadata.decode_seq_lens, scale, num_splits, metadata.sliding_window,
                out=out[:nd])
        if metadata.prefill_seq_lens is not None:
            self._prefill(query[nd:], key_cache, value_cache, metadata.prefill_block_table,
                          metadata.prefill_query_start_loc, metadata.prefill_seq_lens,
                          metadata.max_prefill_query_len, scale, metadata.sliding_window,
                          out=out[nd:])
        return out.view(num_tokens, num_heads * head_dim)

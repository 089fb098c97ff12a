"""Attention on CPU with the compiled kernels (`kernels/cpu`): the decode batch attends
straight from the paged cache, every cached key and value row read once per kv head, instead of
gathering each sequence's blocks into a fresh padded tensor for SDPA in every layer; the new K/V
go into their slots in one pass over the strided projections. Prefill chunks are the torch
backend's (SDPA is efficient on their many query rows).

Without the kernels (PARASHIFT_CPU_KERNELS=0, or no compiler here) it is the torch backend."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from parashift.layers.attention.backend import AttentionStepInputs
from parashift.layers.attention.torch_backend import TorchAttentionBackend
from parashift.layers.kernel_dispatch import cpu_ops


@dataclass
class _PagedDecodes:
    block_tables: torch.Tensor  # [num_decodes, blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_decodes] int32
    window: int | None


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        self.ops = cpu_ops()

    def decode_metadata(self, step: AttentionStepInputs):
        if self.ops is None:
            return super().decode_metadata(step)
        nd = step.num_decodes
        seq_lens = step.seq_lens[:nd]
        num_blocks = int(-(-seq_lens.max() // step.block_size))
        tables = np.ascontiguousarray(step.block_table[:nd, :num_blocks], dtype=np.int32)
        lens = np.ascontiguousarray(seq_lens, dtype=np.int32)
        return _PagedDecodes(torch.from_numpy(tables), torch.from_numpy(lens),
                             step.sliding_window)

    def write_kv(self, key, value, kv_cache, slot_mapping: torch.Tensor) -> None:
        if self.ops is None:
            return super().write_kv(key, value, kv_cache, slot_mapping)
        assert slot_mapping.dtype == torch.int64 and key.stride(1) == key.shape[2]
        self.ops.write_kv(*kv_cache, key, value, slot_mapping)

    def decode(self, out, query, kv_cache, decodes, scale: float) -> None:
        if self.ops is None:
            return super().decode(out, query, kv_cache, decodes, scale)
        self.ops.paged_decode_attention(out, query, *kv_cache, decodes.block_tables,
                                        decodes.seq_lens, decodes.window, scale)

"""Attention on CPU with the compiled kernels (`kernels/cpu`): the decode batch attends
straight from the paged cache, every cached key and value row read once, instead of
gathering each sequence's blocks into a fresh padded tensor for SDPA in every layer; the new K/V
go into their slots in one pass over the strided projections. Where the kernel runs on
AVX512-BF16 dot products (bf16, head_dim 64 or 128) prefill tokens take it too, each token a
query over its own prefix in the cache (faster than torch's flash SDPA there), or, with
head_dim 64 and no sliding window, the tiled prefill kernel, 16 tokens of a chunk at a time (on
AMX tiles where the CPU has them, elsewhere on vdpbf16ps in the decode kernel's order);
without AVX512-BF16 prefill chunks are the torch backend's SDPA calls.

`deterministic` (--deterministic): a prefill token attends in the decode kernel's reduction
order, so it gets the same bits in a decode step or in a prefill chunk of any size, over keys
computed now or cached earlier: on AVX512-BF16 (bf16, head_dim 64, no window) the tiled kernel
on vdpbf16ps, which takes that order (on AMX CPUs too, not the tiles), elsewhere each token a
decode query over its prefix in the cache.

Without the kernels (`--cpu-kernels off`, or no compiler here) it is the torch backend."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from parashift.layers.attention.backend import AttentionStepInputs
from parashift.layers.attention.torch_backend import (
    TorchAttentionBackend,
    TorchAttentionMetadata,
)
from parashift.layers.kernel_dispatch import cpu_ops


@dataclass
class _PagedDecodes:
    block_tables: torch.Tensor  # [num_decodes, blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_decodes] int32
    window: int | None


def _tables(step: AttentionStepInputs, rows: slice) -> np.ndarray:
    """The block tables of `rows`, int32, as wide as their longest sequence needs."""
    num_blocks = int(-(-step.seq_lens[rows].max() // step.block_size))
    return np.ascontiguousarray(step.block_table[rows, :num_blocks], dtype=np.int32)


@dataclass
class _PrefillChunks:
    block_tables: torch.Tensor  # [num_prefills, blocks_per_seq] int32
    query_starts: torch.Tensor  # [num_prefills + 1] int32, from 0 at the first prefill token
    seq_lens: torch.Tensor  # [num_prefills] int32


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    # every prefill token as a query over its own prefix (None without prefills)
    prefill_tokens: _PagedDecodes | None = None
    # the same chunks whole, for the tiled kernel (AMX) where it runs
    prefill_chunks: _PrefillChunks | None = None


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, deterministic: bool = False) -> None:
        self.ops = cpu_ops()
        self.deterministic = deterministic
        if deterministic and self.ops is None:
            raise RuntimeError("--deterministic needs the compiled CPU kernels, which could "
                               "not be built here (is a C++ compiler installed?)")

    def build_metadata(self, step: AttentionStepInputs) -> TorchAttentionMetadata:
        md = super().build_metadata(step)
        nd = step.num_decodes
        per_token = self.ops is not None and (self.ops.bf16_dot or self.deterministic)
        if not per_token or nd == len(step.seq_lens):
            return md
        q_lens = np.diff(step.query_start_loc[nd:])
        chunk_tables = _tables(step, slice(nd, None))
        tables = np.repeat(chunk_tables, q_lens, axis=0)
        # token t of a chunk that starts after c cached tokens sees c + t + 1 keys
        starts = step.query_start_loc[nd:-1]
        within = np.arange(starts[0], starts[0] + q_lens.sum()) - np.repeat(starts, q_lens)
        lens = (within + np.repeat(step.num_computed_tokens[nd:], q_lens) + 1).astype(np.int32)
        tokens = _PagedDecodes(torch.from_numpy(tables), torch.from_numpy(lens),
                               step.sliding_window)
        chunks = None
        if step.sliding_window is None:  # the tiled kernel's
            query_starts = (step.query_start_loc[nd:] - step.query_start_loc[nd]).astype(np.int32)
            seq_lens = np.ascontiguousarray(step.seq_lens[nd:], dtype=np.int32)
            chunks = _PrefillChunks(torch.from_numpy(chunk_tables), torch.from_numpy(query_starts),
                                    torch.from_numpy(seq_lens))
        return CpuAttentionMetadata(md.slot_mapping, nd, md.decodes, md.prefills, tokens, chunks)

    def decode_metadata(self, step: AttentionStepInputs):
        if self.ops is None:
            return super().decode_metadata(step)
        rows = slice(0, step.num_decodes)
        lens = np.ascontiguousarray(step.seq_lens[rows], dtype=np.int32)
        return _PagedDecodes(torch.from_numpy(_tables(step, rows)), torch.from_numpy(lens),
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

    def prefill(self, out, query, key, value, kv_cache, metadata, scale: float) -> None:
        tokens = getattr(metadata, "prefill_tokens", None)
        if tokens is None or not self.deterministic and (
                query.dtype != torch.bfloat16 or query.shape[2] not in (64, 128)):
            return super().prefill(out, query, key, value, kv_cache, metadata, scale)
        nd = metadata.num_decodes  # the K/V of every token are in the cache already
        chunks = metadata.prefill_chunks
        if chunks is not None and self.ops.prefill_attention(
                out[nd:], query[nd:], *kv_cache, chunks.block_tables, chunks.query_starts,
                chunks.seq_lens, scale, decode_order=self.deterministic):
            return
        self.ops.paged_decode_attention(out[nd:], query[nd:], *kv_cache, tokens.block_tables,
                                        tokens.seq_lens, tokens.window, scale)

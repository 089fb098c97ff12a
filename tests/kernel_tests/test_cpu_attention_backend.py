"""The CPU attention backend with the compiled kernels (conftest.py's `ops`: each -march build)
against the torch backend: paged decode attention over grouped query heads, sliding windows
and head sizes that take each instruction set's path, with more threads than sequences, and a
step that mixes decodes, a fresh prompt and a chunk after a cached prefix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernel_tests.test_cpu_kernels import DTYPES, _close
from parashift.layers.attention.backend import AttentionStepInputs
from parashift.layers.attention.torch_backend import TorchAttentionBackend


def _decode_step(seq_lens, table_width, block_size, blocks, window):
    rng = np.random.default_rng(0)
    nd = len(seq_lens)
    table = rng.permutation(blocks)[: nd * table_width].reshape(nd, table_width)
    lens = np.array(seq_lens)
    slots = torch.from_numpy(table[np.arange(nd), (lens - 1) // block_size] * block_size
                             + (lens - 1) % block_size)
    return AttentionStepInputs(np.arange(nd + 1), lens, lens - 1, table, slots, nd, block_size,
                               window, torch.device("cpu"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "window"), [
    (4, 4, 16, None), (6, 2, 16, None), (9, 3, 16, None), (6, 3, 16, 5),
    # head_dim 64 and 128 in bf16 take the AVX512-BF16 path where the build has it, AVX2's
    # (any group of query heads, the 8-key tiles' edges) where it has that
    (9, 3, 64, None), (4, 1, 64, 7), (8, 2, 64, None), (12, 2, 128, None), (2, 2, 128, None)])
def test_paged_decode_attention_matches_the_torch_backend(ops, dtype, heads, kv_heads,
                                                          head_dim, window):
    from parashift.layers.attention.cpu_backend import CpuAttentionBackend

    torch.manual_seed(0)
    block_size, blocks = 4, 64
    step = _decode_step([1, 4, 5, 17, 30, 9], 8, block_size, blocks, window)
    kv_cache = tuple(torch.randn(blocks, block_size, kv_heads, head_dim).to(dtype)
                     for _ in range(2))
    qkv = torch.randn(6, heads + 2 * kv_heads, head_dim).to(dtype)
    q, k, v = (qkv[:, :heads], qkv[:, heads : heads + kv_heads],
               qkv[:, heads + kv_heads :])
    reference = TorchAttentionBackend()
    want = reference.forward(q, k, v, tuple(c.clone() for c in kv_cache),
                             reference.build_metadata(step), 0.25)
    backend = CpuAttentionBackend()
    backend.ops = ops
    got = backend.forward(q, k, v, kv_cache, backend.build_metadata(step), 0.25)
    _close(got, want, dtype, bf16_atol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_attention_with_more_threads_than_sequences(ops, dtype):
    """Threads that get no sequence of their own (5 threads, 2 sequences: the split hands
    thread 1 none) do nothing; the others' results are whole."""
    from parashift.layers.attention.cpu_backend import CpuAttentionBackend

    torch.manual_seed(0)
    step = _decode_step([9, 9], 4, 4, 16, None)
    kv_cache = tuple(torch.randn(16, 4, 3, 64).to(dtype) for _ in range(2))
    qkv = torch.randn(2, 15, 64).to(dtype)
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    reference = TorchAttentionBackend()
    want = reference.forward(q, k, v, tuple(c.clone() for c in kv_cache),
                             reference.build_metadata(step), 0.125)
    backend = CpuAttentionBackend()
    backend.ops = ops
    threads = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        got = backend.forward(q, k, v, kv_cache, backend.build_metadata(step), 0.125)
    finally:
        torch.set_num_threads(threads)
    _close(got, want, dtype, bf16_atol=0.02)


@pytest.mark.parametrize(("head_dim", "window"), [(64, None), (128, None), (64, 6)])
def test_a_mixed_step_matches_the_torch_backend(head_dim, window):
    """Decodes, a fresh prompt and a chunk after a cached prefix in one step, bf16: prefill
    tokens take the kernel where it runs on AVX512-BF16 dot products, SDPA elsewhere."""
    from parashift.layers.attention.cpu_backend import CpuAttentionBackend

    torch.manual_seed(0)
    block_size, blocks, heads, kv_heads = 4, 64, 6, 2
    rng = np.random.default_rng(1)
    # two decodes (lengths 9, 3), a 7-token prompt, 5 new tokens after 6 cached
    q_lens, cached = np.array([1, 1, 7, 5]), np.array([8, 2, 0, 6])
    seq_lens = cached + q_lens
    table = rng.permutation(blocks)[:4 * 5].reshape(4, 5)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    positions = np.concatenate([np.arange(c, s) for c, s in zip(cached, seq_lens, strict=True)])
    rows = np.repeat(np.arange(4), q_lens)
    slots = torch.from_numpy(table[rows, positions // block_size] * block_size
                             + positions % block_size)
    step = AttentionStepInputs(cu, seq_lens, cached, table, slots, 2, block_size, window,
                               torch.device("cpu"))
    kv_cache = tuple(torch.randn(blocks, block_size, kv_heads, head_dim).bfloat16()
                     for _ in range(2))
    qkv = torch.randn(int(cu[-1]), heads + 2 * kv_heads, head_dim).bfloat16()
    q, k, v = (qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :])
    reference = TorchAttentionBackend()
    want = reference.forward(q, k, v, tuple(c.clone() for c in kv_cache),
                             reference.build_metadata(step), head_dim**-0.5)
    backend = CpuAttentionBackend()
    metadata = backend.build_metadata(step)
    if backend.ops.bf16_dot:
        assert metadata.prefill_tokens.seq_lens.tolist() == [1, 2, 3, 4, 5, 6, 7,
                                                              7, 8, 9, 10, 11]
    got = backend.forward(q, k, v, kv_cache, metadata, head_dim**-0.5)
    _close(got, want, torch.bfloat16, bf16_atol=0.02)

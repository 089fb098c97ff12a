"""The compiled CPU kernels against the torch code they replace: every kernel in float32 (to
rounding) and bfloat16 (torch's own bf16 numbers, or within one bf16 step where a reduction's
order differs), on strided inputs as the model passes them; and the build cache."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from parashift.kernels.cpu import build as kernel_build
from parashift.kernels.cpu import library

from kernel_tests.builds import MARCHES, load_for
from parashift.layers.attention.backend import AttentionStepInputs
from parashift.layers.attention.torch_backend import TorchAttentionBackend

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module", params=list(MARCHES))
def ops(request, tmp_path_factory):
    """This CPU's build, and those for older x86 CPUs it can run: each kernel's every path."""
    return load_for(request.param, tmp_path_factory)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, bf16_atol=0.0):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=bf16_atol)


def _rms_norm_reference(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_the_residual_add(ops, dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 2 * 96).to(dtype)[:, :96]  # rows strided, as a view of a wider output
    residual = torch.randn(7, 96).to(dtype)
    weight = torch.randn(96).to(dtype)
    _close(ops.rms_norm(x, weight, 1e-6), _rms_norm_reference(x, weight, 1e-6), dtype,
           bf16_atol=0.05)
    normed, summed = ops.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(summed, x + residual)  # one rounding, as torch's add
    _close(normed, _rms_norm_reference(x + residual, weight, 1e-6), dtype, bf16_atol=0.05)
    assert torch.equal(residual, residual.clone())  # nothing written in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_the_q_and_k_heads_of_a_qkv_view_in_place(ops, dtype):
    torch.manual_seed(0)
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim).to(dtype)
    angles = torch.rand(tokens, head_dim // 2) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = qkv[:, : heads + kv_heads]
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    v_before = qkv[:, heads + kv_heads :].clone()
    got = ops.rotary_(x, cos, sin)
    assert got.data_ptr() == x.data_ptr()
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)  # every product and sum rounded where torch rounds it
    else:
        _close(got, want, dtype)
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(ops, dtype):
    torch.manual_seed(0)
    x = (torch.randn(9, 2 * 40) * 4).to(dtype)  # past exp's easy range
    gate, up = x.chunk(2, dim=-1)
    _close(ops.silu_and_mul(x), F.silu(gate) * up, dtype, bf16_atol=0.07)
    big = torch.tensor([[-100.0, 100.0, 0.0, -0.0, 2.0, 3.0, 1.0, 1.0]]).to(dtype)
    assert ops.silu_and_mul(big).float()[0].tolist() == pytest.approx([-0.0, 300.0, 0.0, -0.0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_fills_the_slots_and_skips_padding(ops, dtype):
    blocks, block_size, kv_heads, head_dim = 4, 4, 2, 8
    key_cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    qkv = torch.randn(3, 3 * kv_heads, head_dim).to(dtype)
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    ops.write_kv(key_cache, value_cache, key, value, torch.tensor([13, -1, 2]))
    flat_k, flat_v = key_cache.view(-1, kv_heads, head_dim), value_cache.view(-1, kv_heads,
                                                                             head_dim)
    assert torch.equal(flat_k[13], key[0]) and torch.equal(flat_v[2], value[2])
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    written[[13, 2]] = True
    assert not flat_k[~written].any() and not flat_v[~written].any()


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


def test_the_build_is_cached_per_cpu_and_rebuilt_when_corrupt(tmp_path, monkeypatch):
    # unoptimized: three builds in seconds (the caching is under test here, not the code)
    monkeypatch.setattr(kernel_build, "_FLAGS",
                        ["-O0" if f == "-O3" else f for f in kernel_build._FLAGS])
    build_dir = str(tmp_path)
    first = kernel_build.build(build_dir)
    built_at = os.stat(first).st_mtime_ns
    assert kernel_build.build(build_dir) == first and os.stat(first).st_mtime_ns == built_at
    monkeypatch.setattr(kernel_build, "_cpu_identity", lambda: "another CPU")
    other = kernel_build.build(build_dir)
    assert other != first and os.path.exists(first)
    with open(other, "wb") as f:
        f.write(b"not a library")
    ops = library.load(build_dir)  # its sha256 no longer matches: built again before loading
    assert ops.path == other and os.path.getsize(other) > 1000


def test_a_planted_library_is_never_loaded(tmp_path, monkeypatch):
    """A file put under the library's predictable name (a shared or writable cache folder) is
    rebuilt over, not dlopen'ed: only a library this build wrote, with its sha256 beside it,
    loads."""
    monkeypatch.setattr(kernel_build, "_FLAGS",
                        ["-O0" if f == "-O3" else f for f in kernel_build._FLAGS])
    compiler = kernel_build.shutil.which("g++") or kernel_build.shutil.which("c++")
    path = kernel_build.library_path(str(tmp_path), compiler)
    planted = tmp_path / "planted.c"
    planted.write_text("__attribute__((constructor)) static void run(void) {"
                       " __builtin_trap(); }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-x", "c", str(planted), "-o", path],
                   check=True)
    with open(f"{path}.sha256", "w") as f:
        f.write("0" * 64)  # a digest that is not the file's
    ops = library.load(str(tmp_path))  # the planted file would abort this process on load
    assert ops.path == path and kernel_build.is_intact(path)


def test_no_compiler_means_no_kernels_and_the_torch_path(tmp_path, monkeypatch, caplog):
    from parashift.layers import kernel_dispatch

    monkeypatch.setattr(kernel_build.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        kernel_build.build(str(tmp_path))
    monkeypatch.setenv("PARASHIFT_CACHE_DIR", str(tmp_path))
    kernel_dispatch.cpu_ops.cache_clear()
    try:
        assert kernel_dispatch.cpu_ops() is None
        assert "CPU kernels unavailable" in caplog.text
        assert not kernel_dispatch.on_cpu_kernels(torch.zeros(1))
    finally:
        kernel_dispatch.cpu_ops.cache_clear()


def test_cpu_kernels_off_turns_them_off(tiny_llama):
    from parashift import LLM, SamplingParams
    from parashift.config import DeviceConfig
    from parashift.layers import kernel_dispatch
    from parashift.layers.attention.cpu_backend import CpuAttentionBackend

    try:
        llm = LLM(tiny_llama, cpu_kernels="off", max_model_len=64)
        try:
            assert kernel_dispatch.cpu_ops() is None
            assert CpuAttentionBackend().ops is None  # then it is the torch backend
            out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 2
        finally:
            llm.shutdown()
    finally:
        kernel_dispatch.use_cpu_kernels("native")
    assert kernel_dispatch.cpu_ops() is not None
    for bad in ("native; rm -rf /", "-O0", ""):
        with pytest.raises(ValueError, match="--cpu-kernels"):
            DeviceConfig("cpu", cpu_kernels=bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_is_torchs_first_of_equals_with_nan_winning(ops, dtype):
    torch.manual_seed(0)
    x = torch.randn(12, 1000).to(dtype)
    x[0, 100] = x[0, 900] = 50.0  # the first of equals
    x[1, 999] = 60.0  # in the last, partial chunk
    x[2] = -3.0
    x[2, 7], x[2, 9] = -0.0, 0.0  # equal: the first
    x[3], x[4] = -float("inf"), float("inf")
    x[5, 300], x[5, 700] = float("nan"), float("nan")
    x[6, 5] = -float("nan")
    assert ops.argmax(x).tolist() == x.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_take_a_step_without_tokens(dtype):
    """An expert-parallel dummy step runs the layers on zero tokens."""
    from parashift.layers.activation import silu_and_mul
    from parashift.layers.norm import RMSNorm
    from parashift.layers.rotary import RotaryEmbedding, apply_rotary

    x = torch.zeros(0, 3, 8, dtype=dtype)
    cos, sin = RotaryEmbedding(8, 16, {"rope_theta": 1e4, "rope_type": "default"}).cos_sin(
        torch.zeros(0, dtype=torch.long), dtype)
    assert apply_rotary(x, cos, sin).shape == (0, 3, 8)
    norm = RMSNorm(8, 1e-6, dtype)
    hidden = torch.zeros(0, 8, dtype=dtype)
    assert norm(hidden).shape == (0, 8) and norm(hidden, hidden)[1].shape == (0, 8)
    assert silu_and_mul(torch.zeros(0, 16, dtype=dtype)).shape == (0, 8)


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

"""The compiled CPU kernels against the torch code they replace: RMSNorm (with the residual
add), rotary, SiLU-and-mul, the KV cache write and argmax, in float32 (to rounding) and bfloat16
(torch's own bf16 numbers, or within one bf16 step where a reduction's order differs), on
strided inputs as the model passes them, for this CPU's build and those of older x86 CPUs it
can run. test_cpu_attention_backend.py checks the attention kernels with the same builds,
test_cpu_kernel_build.py the build cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16)


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

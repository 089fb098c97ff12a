"""RMSNorm (with and without the fused residual add) and rotary embedding against their torch
references; the rotary tables come from the layer, llama3 scaling included. Bounds: 1e-5 in
fp32, 2e-3 in fp16."""

import pytest
import torch
from parashift.kernels.rms_norm import rms_norm, rms_norm_reference
from parashift.kernels.rotary import apply_rotary, apply_rotary_reference

from kernel_tests.conftest import DEVICE
from parashift.layers.rotary import RotaryEmbedding

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 576), (33, 100)])
def test_rms_norm(dtype, num_tokens, hidden):
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=DEVICE)
    residual = torch.randn(num_tokens, hidden, dtype=dtype, device=DEVICE)
    weight = torch.randn(hidden, dtype=dtype, device=DEVICE)
    got = rms_norm(x, weight, 1e-6)
    want = rms_norm_reference(x.cpu(), weight.cpu(), 1e-6)
    assert (got.cpu().float() - want.float()).abs().max() < TOLERANCE[dtype] * 4
    got, got_sum = rms_norm(x, weight, 1e-6, residual)
    want, want_sum = rms_norm_reference(x.cpu(), weight.cpu(), 1e-6, residual.cpu())
    assert torch.equal(got_sum.cpu(), want_sum)
    assert (got.cpu().float() - want.float()).abs().max() < TOLERANCE[dtype] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
@pytest.mark.parametrize("num_q_heads,num_k_heads,head_dim", [(9, 3, 64), (4, 4, 32)])
def test_rotary_in_place_on_views_of_the_qkv_output(dtype, params, num_q_heads, num_k_heads,
                                                    head_dim):
    rope = RotaryEmbedding(head_dim, 512, params).to(DEVICE)
    num_tokens = 11
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_k_heads) * head_dim, dtype=dtype,
                      device=DEVICE)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_k_heads) * head_dim].view(
        num_tokens, num_k_heads, head_dim)
    positions = torch.randint(0, 512, (num_tokens,), device=DEVICE)
    want_q, want_k = apply_rotary_reference(q.cpu(), k.cpu(), rope.cos_sin_cache[0].cpu(),
                                            rope.cos_sin_cache[1].cpu(), positions.cpu())
    v_before = qkv[:, (num_q_heads + num_k_heads) * head_dim :].clone()
    apply_rotary(q, k, rope.cos_sin_cache[0], rope.cos_sin_cache[1], positions)
    assert (q.cpu().float() - want_q.float()).abs().max() < TOLERANCE[dtype] * 2
    assert (k.cpu().float() - want_k.float()).abs().max() < TOLERANCE[dtype] * 2
    assert torch.equal(qkv[:, (num_q_heads + num_k_heads) * head_dim :], v_before)

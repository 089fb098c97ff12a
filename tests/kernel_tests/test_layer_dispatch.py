"""The layers' CUDA branches (RMSNorm, rotary, the routed experts) call the kernels with the
right arguments: forced on here for CPU tensors under the interpreter, they equal the layers'
own torch code."""

import torch

from parashift.distributed.parallel_context import ParallelContext
from parashift.layers import fused_moe, norm, rotary
from parashift.layers.fused_moe import FusedMoE, route


def test_rms_norm_layer(monkeypatch):
    layer = norm.RMSNorm(96, 1e-5, torch.float32)
    layer.weight.data.normal_()
    x, residual = torch.randn(5, 96), torch.randn(5, 96)
    want, want_sum = layer(x, residual)
    monkeypatch.setattr(norm, "on_kernels", lambda _: True)
    got, got_sum = layer(x, residual)
    assert torch.allclose(got, want, atol=1e-5) and torch.equal(got_sum, want_sum)
    assert torch.allclose(layer(x), layer._norm(x), atol=1e-5)


def test_rotary_layer_on_a_view_of_the_qkv_output(monkeypatch):
    rope = rotary.RotaryEmbedding(32, 128, {"rope_type": "default", "rope_theta": 10000.0})
    qkv = torch.randn(7, 4 + 2 + 2, 32)
    positions = torch.tensor([0, 5, 9, 3, 127, 64, 1])
    cos, sin = rope.cos_sin(positions, torch.float32)
    want = rotary.apply_rotary(qkv[:, :6], cos, sin)
    monkeypatch.setattr(rotary, "on_kernels", lambda _: True)
    got = rotary.apply_rotary(qkv[:, :6], cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    assert torch.allclose(got, want, atol=1e-5)


def test_routed_experts_with_experts_held_elsewhere(monkeypatch):
    """8 experts, top-2; this rank holds experts 2..5 (as under expert parallel)."""
    layer = FusedMoE(8, 2, 64, 32, True, torch.float32, ParallelContext())
    layer.first_expert, layer.num_local_experts = 2, 4
    layer.w13.data = torch.randn(4, 64, 64) / 8
    layer.w2.data = torch.randn(4, 64, 32) / 6
    tokens = torch.randn(19, 64)
    weights, ids = route(torch.randn(19, 8), 2, True)
    ids[3, 0] = -1  # a padding row of the dispatcher routes nowhere
    want = layer._experts(tokens, weights, ids)
    monkeypatch.setattr(fused_moe, "on_kernels", lambda _: True)
    got = layer._experts(tokens, weights, ids)
    assert torch.allclose(got, want, atol=1e-4)

"""The MoE sort-and-align step and the fused grouped GEMMs against their references: many
experts with top-2, experts that get no token, slots routed to another rank's experts, and
the tile size switch. Bounds: 1e-4 in fp32, 1e-2 in fp16 (outputs are O(1))."""

import pytest
import torch
from parashift.kernels.fused_moe import fused_moe, fused_moe_reference
from parashift.kernels.moe_align import align_slots, align_slots_reference

from kernel_tests.conftest import DEVICE

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2}


@pytest.mark.parametrize("num_tokens,num_experts,block_m", [(1, 4, 16), (37, 16, 16),
                                                            (300, 5, 64)])
def test_align_matches_its_reference(num_tokens, num_experts, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(-1, num_experts + 1, (num_tokens, 2), generator=gen)  # some not here
    ids[ids == 1] = 0  # expert 1 gets no token
    got = align_slots(ids.to(DEVICE), num_experts, block_m)
    want = align_slots_reference(ids, num_experts, block_m)
    assert torch.equal(got.sorted_ids.cpu(), want.sorted_ids)
    assert torch.equal(got.expert_ids.cpu(), want.expert_ids)
    assert torch.equal(got.num_padded.cpu(), want.num_padded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,hidden,intermediate", [
    (5, 16, 64, 48), (40, 8, 96, 64), (260, 4, 32, 32)])
def test_fused_moe_top2(dtype, num_tokens, num_experts, hidden, intermediate):
    gen = torch.Generator().manual_seed(num_tokens * num_experts)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / hidden ** 0.5)
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) / intermediate ** 0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, 2] = -1e9  # an expert nobody picks
    weights, ids = logits.softmax(-1).topk(2, dim=-1)
    ids[0, 1] = num_experts  # a slot whose expert another rank holds: adds nothing
    got = fused_moe(x.to(DEVICE), w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE),
                    weights.to(DEVICE), ids.to(DEVICE))
    want = fused_moe_reference(x, w13.to(dtype), w2.to(dtype), weights, ids)
    assert (got.cpu().float() - want.float()).abs().max() < TOLERANCE[dtype]

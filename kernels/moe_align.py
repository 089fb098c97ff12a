"""The sort-and-align step of the fused MoE: the (token, choice) slots, grouped by expert and
each expert's group padded to a multiple of BLOCK_M, so that every tile of the grouped GEMM
belongs to one expert.

Two passes with one program per expert (no atomics, so the order is deterministic: an
expert's slots keep their order): count each expert's slots, then place them after the padded
groups of the experts before it. A slot whose id is outside [0, num_experts) (an expert that
another rank holds) is placed nowhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CHUNK = 256  # slots a program reads at a time


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_slots, CHUNK: tl.constexpr):
    expert = tl.program_id(0)
    total = 0
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1)
        total += tl.sum((ids == expert).to(tl.int32), 0)
    tl.store(counts_ptr + expert, total)


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                  num_slots, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  CHUNK: tl.constexpr):
    expert = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    first = tl.sum(tl.where(e < expert, padded, 0), 0)  # where this expert's group starts
    if expert == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    mine = tl.sum(tl.where(e == expert, padded, 0), 0)
    for block in range(first // BLOCK_M, (first + mine) // BLOCK_M):
        tl.store(expert_ids_ptr + block, expert)
    placed = first
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        hit = tl.load(ids_ptr + offs, mask=offs < num_slots, other=-1) == expert
        hit32 = hit.to(tl.int32)
        where = placed + tl.cumsum(hit32, 0) - 1
        tl.store(sorted_ids_ptr + where, offs, mask=hit)
        placed += tl.sum(hit32, 0)


@dataclass
class AlignedSlots:
    sorted_ids: torch.Tensor  # [max_padded] int32 slot index, `num_slots` in the padding
    expert_ids: torch.Tensor  # [max_padded // block_m] int32 expert of each tile, -1 unused
    num_padded: torch.Tensor  # [1] int32: tiles in use * block_m
    block_m: int


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    return triton.cdiv(num_slots + num_experts * (block_m - 1), block_m) * block_m


def align_slots(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedSlots:
    """topk_ids: [num_tokens, top_k], local expert ids (outside [0, num_experts): not here)."""
    ids = topk_ids.reshape(-1).to(torch.int32)
    num_slots, dev = ids.numel(), ids.device
    size = max_padded_slots(num_slots, num_experts, block_m)
    sorted_ids = torch.full((size,), num_slots, dtype=torch.int32, device=dev)
    expert_ids = torch.full((size // block_m,), -1, dtype=torch.int32, device=dev)
    num_padded = torch.zeros(1, dtype=torch.int32, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    _count_kernel[(num_experts,)](ids, counts, num_slots, CHUNK=CHUNK)
    _place_kernel[(num_experts,)](ids, counts, sorted_ids, expert_ids, num_padded, num_slots,
                                  num_experts, BLOCK_M=block_m,
                                  BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=CHUNK)
    return AlignedSlots(sorted_ids, expert_ids, num_padded, block_m)


def align_slots_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int
                          ) -> AlignedSlots:
    ids = topk_ids.reshape(-1).long().cpu()
    num_slots = ids.numel()
    size = max_padded_slots(num_slots, num_experts, block_m)
    sorted_ids = torch.full((size,), num_slots, dtype=torch.int32)
    expert_ids = torch.full((size // block_m,), -1, dtype=torch.int32)
    at = 0
    for expert in range(num_experts):
        slots = (ids == expert).nonzero().flatten()
        sorted_ids[at : at + len(slots)] = slots.int()
        padded = -(-len(slots) // block_m) * block_m
        expert_ids[at // block_m : (at + padded) // block_m] = expert
        at += padded
    return AlignedSlots(sorted_ids, expert_ids, torch.tensor([at], dtype=torch.int32), block_m)

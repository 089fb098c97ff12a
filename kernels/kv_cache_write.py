"""KV-cache write: each new token's key and value go to their slot in the paged cache.

slot = block_id * block_size + offset, from the step's `slot_mapping`; a negative slot (a
padded row of a captured CUDA graph) writes nothing."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                     key_stride, value_stride, ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        key = tl.load(key_ptr + token * key_stride + offs, mask=mask)
        value = tl.load(value_ptr + token * value_stride + offs, mask=mask)
        tl.store(key_cache_ptr + slot * ROW + offs, key, mask=mask)
        tl.store(value_cache_ptr + slot * ROW + offs, value, mask=mask)


def _check_rows(x: torch.Tensor) -> None:
    # a token's [num_kv_heads, head_dim] must be one contiguous row (a view of the qkv
    # projection's output is)
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "a token's K/V must be contiguous"


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size,
    num_kv_heads, head_dim], contiguous; slot_mapping: [num_tokens]."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _check_rows(key)
    _check_rows(value)
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    row = key.shape[1] * key.shape[2]
    _write_kv_kernel[(num_tokens,)](key, value, key_cache, value_cache, slot_mapping,
                                    key.stride(0), value.stride(0), ROW=row,
                                    BLOCK=triton.next_power_of_2(row))


def write_kv_cache_reference(key, value, key_cache, value_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.view(-1, *key.shape[1:])[slots] = key[keep]
    value_cache.view(-1, *value.shape[1:])[slots] = value[keep]

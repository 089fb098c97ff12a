"""The packed GEMM weights in transparent huge pages."""

import itertools
import re

import pytest
import torch
from parashift.kernels.cpu import huge_pages

pytestmark = pytest.mark.skipif(not huge_pages.available(), reason="no MADV_HUGEPAGE here")


def _advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte carries VmFlags `hg` (MADV_HUGEPAGE)."""
    address = t.data_ptr()
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return " hg" in line
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.parametrize("shape,dtype", [((300, 7, 3, 64), torch.bfloat16),  # own mapping
                                         ((36, 288, 32), torch.bfloat16),  # in a chunk
                                         ((5, 3), torch.int8), ((0, 16, 3, 64), torch.float32)])
def test_zeros_are_zero_aligned_contiguous_and_advised(shape, dtype):
    t = huge_pages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % huge_pages.ALIGN == 0
    assert not t.any()
    if t.numel():
        assert _advised(t)
        t.fill_(1)  # writable
        assert t.sum() == t.numel()


def test_big_tensors_start_on_a_huge_page_and_small_ones_do_not_overlap():
    big = huge_pages.zeros((huge_pages.CHUNK,), torch.uint8)
    assert big.data_ptr() % huge_pages.HUGE_PAGE == 0
    small = [huge_pages.zeros((1000,), torch.bfloat16) for _ in range(3)]
    for t in small:
        t.fill_(2)
    spans = sorted((t.data_ptr(), t.data_ptr() + 2000) for t in small)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))
    assert all(bool((t == 2).all()) for t in small)


def test_packed_weights_live_there():
    from parashift.layers.kernel_dispatch import cpu_ops

    ops = cpu_ops()
    if ops is None or ops.bf16_gemm is None:
        pytest.skip("no bf16 GEMM of ours on this CPU")
    packed = ops.pack_bf16(torch.randn(96, 64).bfloat16())
    assert _advised(packed)

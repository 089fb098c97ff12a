"""Our weight-only int8 GEMM (`--quantization int8`; kernels/cpu/gemm_int8.h on AMX, the bf16
GEMM's register blocks over widened columns elsewhere) against a float64 product with the
dequantized weight: the edges of its blocking (partial 16-column blocks, narrower last tiles,
16-row tiles, decode batches up to 32 rows where AMX widens each chunk on the way, bigger
panels widened once), a bias, strided rows; and where it is refused. Built for this CPU and
for older x86 ones it can run (Haswell's FMA kernel on AVX2, AVX-512F); on a CPU with AMX a k
off its 32-wide tiles takes vdpbf16ps, so that form is checked too."""

from __future__ import annotations

import pytest
import torch

from kernel_tests.builds import MARCHES, load_for


@pytest.fixture(scope="module", params=[m for m in MARCHES if m != "x86-64"])
def ops(request, tmp_path_factory):
    ops = load_for(request.param, tmp_path_factory)
    if not ops.int8_gemm:
        pytest.skip(f"no int8 GEMM of ours built for -march={request.param}")
    return ops


def _check(ops, rows: int, n: int, k: int, bias: bool, strided: bool = False):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) * 0.01 + 1e-3).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    wide = torch.randn(rows, 2 * k if strided else k, generator=g).bfloat16()
    x = wide[:, :k]
    out = ops.gemm_int8(x, ops.pack_int8(q), scale, b)
    weight = q.double() * scale.double()[:, None]
    want = x.double() @ weight.t() + (0 if b is None else b.double())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # the weight exact in bf16, fp32 sums in another order, then one rounding to bf16
    torch.testing.assert_close(out.double(), want, rtol=2 ** -7, atol=1e-3 * k ** 0.5)


@pytest.mark.parametrize("k", [64, 48])
@pytest.mark.parametrize("rows", [1, 5, 15, 16, 17, 32, 33, 48, 257, 300])
def test_rows_around_the_register_blocks_and_the_panel(ops, rows, k):
    _check(ops, rows, 160, k, bias=False)  # 10 blocks: two whole tiles, a last of two


@pytest.mark.parametrize("rows", [5, 29, 40])
@pytest.mark.parametrize("n", [1, 15, 17, 48, 64, 65, 200])
def test_partial_blocks_and_narrow_last_tiles(ops, n, rows):
    _check(ops, rows, n, 32, bias=True)


@pytest.mark.parametrize("rows", [9, 70])
def test_strided_rows_and_a_long_k(ops, rows):
    _check(ops, rows, 96, 1536, bias=True, strided=True)


def test_the_same_bits_from_any_thread_count_while_threads_take_each_others_columns(ops):
    """As for the bf16 GEMM: 7 threads on this machine's cores, 23 blocks, k off AMX's tiles."""
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-127, 128, (23 * 16, 48), generator=g, dtype=torch.int8)
    scale = (torch.rand(23 * 16, generator=g) * 0.01 + 1e-3).bfloat16()
    x = torch.randn(100, 48, generator=g).bfloat16()
    packed = ops.pack_int8(q)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = ops.gemm_int8(x, packed, scale, None)
        torch.set_num_threads(7)
        for _ in range(20):
            assert torch.equal(ops.gemm_int8(x, packed, scale, None), want)
    finally:
        torch.set_num_threads(threads)


def test_no_rows_is_an_empty_result(ops):
    q = torch.ones(40, 32, dtype=torch.int8)
    out = ops.gemm_int8(torch.empty(0, 32, dtype=torch.bfloat16), ops.pack_int8(q),
                        torch.ones(40, dtype=torch.bfloat16), None)
    assert out.shape == (0, 40)


def test_mismatched_scales_or_weights_are_refused_before_the_kernel_reads_them(ops):
    packed = ops.pack_int8(torch.ones(40, 32, dtype=torch.int8))
    x = torch.randn(3, 32).bfloat16()
    with pytest.raises(ValueError, match="bias and scale"):
        ops.gemm_int8(x, packed, torch.ones(40), None)  # fp32 scales
    with pytest.raises(ValueError, match="packed weight must be"):
        ops.gemm_int8(x, packed, torch.ones(56, dtype=torch.bfloat16), None)  # 4 blocks, not 3
    with pytest.raises(ValueError, match="packed weight must be"):
        ops.gemm_int8(x, ops.pack_bf16(torch.ones(40, 32).bfloat16()),
                      torch.ones(40, dtype=torch.bfloat16), None)  # a bf16 packing


@pytest.mark.parametrize("q", [torch.ones(16, 7, dtype=torch.int8), torch.ones(16, 32)])
def test_an_odd_k_or_another_dtype_is_refused(ops, q):
    with pytest.raises(RuntimeError, match="no int8 GEMM of ours"):
        ops.pack_int8(q)


def test_a_baseline_x86_64_build_has_none(tmp_path_factory):
    """Nor on ARM: torch's int8 kernel takes the weights there."""
    baseline = load_for("x86-64", tmp_path_factory)
    assert not baseline.int8_gemm
    with pytest.raises(RuntimeError, match="needs AVX2 with FMA"):
        baseline.pack_int8(torch.ones(16, 32, dtype=torch.int8))

"""The bf16 GEMM kernel (kernels/cpu/gemm.cpp) against a float64 product: every edge of its
blocking (a partial 16-column block, a narrower last tile, row counts around the 4- and 6-row
register blocks and the 384-row panel, or the AMX path's 16-row tiles and 256-row panel), a
bias, strided rows; and where it is refused. On a CPU with AMX, k a multiple of 32 runs on tiles
and other k on vdpbf16ps, so both kernels are checked there. The kernels are also built for
older x86 CPUs this one can run (-march=haswell: the FMA kernel on AVX2; skylake-avx512: on
AVX-512F), so the forms other machines take are checked here too."""

from __future__ import annotations

import pytest
import torch

from kernel_tests.builds import MARCHES, cpu_flags, load_for


@pytest.fixture(scope="module", params=[m for m in MARCHES if m != "x86-64"])
def march(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ops(march, tmp_path_factory):
    ops = load_for(march, tmp_path_factory)
    if ops.bf16_gemm is None:
        pytest.skip(f"no bf16 GEMM of ours built for -march={march}")
    return ops


def test_each_target_takes_the_kernel_its_instructions_allow(ops, march):
    flags = cpu_flags()
    if march == "cooperlake":  # AVX512-BF16, no AMX
        assert (ops.bf16_gemm, ops.bf16_dot) == ("dpbf16", True)
    elif march != "native" or "avx512_bf16" not in flags:  # AVX2 or AVX-512F: the FMA kernel
        assert (ops.bf16_gemm, ops.bf16_dot) == ("fma", False)
    else:  # AMX where the OS grants its tiles
        assert ops.bf16_gemm in ("dpbf16", "amx") and ops.bf16_dot
        assert ops.bf16_gemm == "dpbf16" or "amx_bf16" in flags


def test_a_baseline_x86_64_build_has_no_gemm_of_ours(tmp_path_factory):
    """Nor on ARM: its bf16 weights take torch's paths (gemm_paths.py times them)."""
    baseline = load_for("x86-64", tmp_path_factory)
    assert (baseline.bf16_gemm, baseline.bf16_dot, baseline.bf16_attention) == (None, False,
                                                                                 False)
    with pytest.raises(RuntimeError, match="needs AVX2 with FMA"):
        baseline.pack_bf16(torch.zeros(16, 32, dtype=torch.bfloat16))


def _check(ops, rows: int, n: int, k: int, bias: bool, strided: bool = False):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    weight = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    wide = torch.randn(rows, 2 * k if strided else k, generator=g).bfloat16()
    x = wide[:, :k]  # strided: a view of a wider output, as the model passes q/k/v slices
    out = ops.gemm_bf16(x, ops.pack_bf16(weight), n, b)
    want = x.double() @ weight.double().t() + (0 if b is None else b.double())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # fp32 sums in another order, then one rounding to bf16: within two bf16 steps
    torch.testing.assert_close(out.double(), want, rtol=2 ** -7, atol=0.05 * k ** 0.5)


@pytest.mark.parametrize("k", [64, 40])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 7, 16, 17, 32, 33, 257, 385])
def test_rows_around_the_register_block_and_the_panel(ops, rows, k):
    _check(ops, rows, 160, k, bias=False)  # 10 blocks: two whole tiles, a last of two


@pytest.mark.parametrize("rows", [33, 100, 300])
def test_a_row_block_gives_the_same_bits_alone_and_in_a_panel(ops, rows):
    """A long k (20 AMX chunks of 32) over several row blocks: the rows come out as the
    reference, and bit for bit as the same rows multiplied alone (each element one sum over k
    in one order, whatever the row blocks around it: a prefill chunk and a decode step agree)."""
    _check(ops, rows, 160, 640, bias=True)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(160, 640, generator=g).bfloat16()
    x = torch.randn(rows, 640, generator=g).bfloat16()
    packed = ops.pack_bf16(weight)
    whole = ops.gemm_bf16(x, packed, 160, None)
    for r in range(0, rows, 32):
        alone = ops.gemm_bf16(x[r : r + 32].contiguous(), packed, 160, None)
        assert torch.equal(whole[r : r + 32], alone)


@pytest.mark.parametrize("rows", [13, 29])
@pytest.mark.parametrize("n", [1, 15, 17, 48, 64, 65, 200])
def test_partial_blocks_and_narrow_last_tiles(ops, n, rows):
    _check(ops, rows, n, 32, bias=True)


def test_strided_rows_and_a_long_k(ops):
    _check(ops, 9, 96, 1536, bias=True, strided=True)


@pytest.mark.parametrize("k", [40, 64])
def test_the_same_bits_from_any_thread_count_while_threads_take_each_others_columns(ops, k):
    """7 threads on this machine's cores lose them to each other all the time, so threads that
    finish take chunks from the back of another's share (column_shares.h): 23 blocks split
    unevenly across tiles, three row panels (four of AMX's 256 rows). Each element still comes
    from one micro-kernel run, so the result is bit for bit the one-thread result. k = 40 keeps
    an AMX CPU on the register blocks (its tiles take k % 32 == 0), k = 64 on its tiles."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(23 * 16, k, generator=g).bfloat16()
    x = torch.randn(800, k, generator=g).bfloat16()
    packed = ops.pack_bf16(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = ops.gemm_bf16(x, packed, 23 * 16, None)
        torch.set_num_threads(7)
        for _ in range(20):
            assert torch.equal(ops.gemm_bf16(x, packed, 23 * 16, None), want)
    finally:
        torch.set_num_threads(threads)


def test_no_rows_is_an_empty_result(ops):
    weight = torch.randn(40, 8).bfloat16()
    out = ops.gemm_bf16(torch.empty(0, 8, dtype=torch.bfloat16), ops.pack_bf16(weight), 40, None)
    assert out.shape == (0, 40)


@pytest.mark.parametrize("weight", [torch.randn(16, 7).bfloat16(), torch.randn(16, 8)])
def test_an_odd_k_or_another_dtype_is_refused(ops, weight):
    with pytest.raises(RuntimeError, match="no bf16 GEMM of ours"):
        ops.pack_bf16(weight)


def test_mismatched_operands_are_refused_before_the_kernel_reads_them(ops):
    packed = ops.pack_bf16(torch.randn(40, 8).bfloat16())
    x = torch.randn(3, 8).bfloat16()
    with pytest.raises(ValueError, match="packed weight must be"):
        ops.gemm_bf16(torch.randn(3, 16).bfloat16(), packed, 40, None)  # another k
    with pytest.raises(ValueError, match="packed weight must be"):
        ops.gemm_bf16(x, packed, 80, None)  # more columns than packed
    with pytest.raises(ValueError, match="x must be"):
        ops.gemm_bf16(x.float(), packed, 40, None)
    with pytest.raises(ValueError, match="x must be"):
        ops.gemm_bf16(torch.randn(8, 3).bfloat16().t(), packed, 40, None)  # strided columns
    with pytest.raises(ValueError, match="bias and scale"):
        ops.gemm_bf16(x, packed, 40, torch.zeros(39, dtype=torch.bfloat16))

"""Our weight-only int8 GEMM (kernels/cpu/gemm_int8.h, `--quantization int8` where the CPU has
AMX) against a float64 product with the dequantized weight: the edges of its blocking (partial
16-column blocks, narrower last tiles, 16-row tiles, decode batches up to 32 rows where each
chunk is widened on the way, and bigger panels widened once), a bias, strided rows; and where
it is refused. On CPUs without AMX torch's int8 kernel runs instead (tests/layers/
test_quantization.py holds both to the same reference)."""

from __future__ import annotations

import pytest
import torch

from parashift.layers.kernel_dispatch import cpu_ops
from tests.kernels.builds import load_for


@pytest.fixture(scope="module")
def ops():
    ops = cpu_ops()
    if ops is None or not ops.int8_gemm:
        pytest.skip("no int8 GEMM of ours on this CPU (it needs AMX)")
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


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 48, 256, 257, 300])
def test_rows_around_the_tiles_the_decode_batch_and_the_panel(ops, rows):
    _check(ops, rows, 160, 64, bias=False)  # 10 blocks: two whole tiles, a last of two


@pytest.mark.parametrize("rows", [5, 29, 40])
@pytest.mark.parametrize("n", [1, 15, 17, 48, 64, 65, 200])
def test_partial_blocks_and_narrow_last_tiles(ops, n, rows):
    _check(ops, rows, n, 32, bias=True)


@pytest.mark.parametrize("rows", [9, 70])
def test_strided_rows_and_a_long_k(ops, rows):
    _check(ops, rows, 96, 1536, bias=True, strided=True)


def test_no_rows_is_an_empty_result(ops):
    q = torch.ones(40, 32, dtype=torch.int8)
    out = ops.gemm_int8(torch.empty(0, 32, dtype=torch.bfloat16), ops.pack_int8(q),
                        torch.ones(40, dtype=torch.bfloat16), None)
    assert out.shape == (0, 40)


@pytest.mark.parametrize("q", [torch.ones(16, 48, dtype=torch.int8), torch.ones(16, 32)])
def test_a_k_off_the_tiles_or_another_dtype_is_refused(ops, q):
    with pytest.raises(RuntimeError, match="no int8 GEMM of ours"):
        ops.pack_int8(q)


def test_a_cpu_without_amx_has_none(tmp_path_factory):
    """AVX-512 without AMX (a Skylake-SP build): torch's int8 kernel takes the weights."""
    avx512 = load_for("skylake-avx512", tmp_path_factory)
    assert not avx512.int8_gemm
    with pytest.raises(RuntimeError, match="needs AMX"):
        avx512.pack_int8(torch.ones(16, 32, dtype=torch.int8))

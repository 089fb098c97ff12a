"""`python scripts/bench_cpu_kernels.py`: every compiled CPU kernel checked against the torch ops it
replaces (the command fails on a mismatch), timed, and a JSON record; bad flags named."""

from __future__ import annotations

import json

import pytest
from bench_cpu_kernels import GEMM_KERNELS

from bench.test_bench_commands import invoke
from parashift.layers.kernel_dispatch import cpu_ops


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_kernel_matches_torch_and_is_timed(dtype, tmp_path):
    out = tmp_path / "cpu.json"
    code, text = invoke("cpu-kernels", "--batch", "4", "--context", "40", "--reps", "2",
                        "--dtype", dtype, "--save-json", str(out))
    assert code == 0, text
    assert "FAIL" not in text
    rows = json.loads(out.read_text())["results"]["kernels"]
    ops = cpu_ops()
    kernel = GEMM_KERNELS.get(ops.bf16_gemm) if ops is not None else None
    gemms = ([f"{name} GEMM ({kernel})" for name in ("QKV", "O", "gate_up", "down", "LM head")]
             + [f"{name} int8 GEMM ({kernel})" for name in ("QKV", "O", "gate_up", "down")]
             if dtype == "bfloat16" and kernel else [])
    assert [r["kernel"] for r in rows] == ["decode attention + KV write", "RMSNorm + residual",
                                           "rotary (neox, in place)", "SiLU and mul",
                                           "greedy argmax", *gemms]
    assert all(r["ok"] and r["seconds"] > 0 and r["torch_seconds"] > 0 for r in rows)


def test_a_dtype_the_kernels_lack_is_refused_naming_the_flag():
    code, text = invoke("cpu-kernels", "--dtype", "float16")
    assert code != 0 and "--dtype 'float16': the CPU kernels run float32 and bfloat16" in text


def test_an_unknown_gemm_comparator_is_refused_naming_the_flag():
    code, text = invoke("cpu-kernels", "--gemm-against", "mkl")
    assert code != 0 and "--gemm-against 'mkl': choose onednn or inductor" in text


# A cold compile, about 30 s on two cores, for a comparator the engine does not use (inductor
# measured slower than our GEMM, BENCHMARKS): out of the suite, `pytest -m extended` runs it.
@pytest.mark.extended
def test_inductors_compiled_gemm_computes_x_w_transposed(tmp_path, monkeypatch):
    import torch
    from inductor_gemm import compile_linear

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # no graph of another run
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=g).bfloat16()
    x = torch.randn(4, 64, generator=g).bfloat16()
    run, seconds = compile_linear(weight, x)
    assert seconds > 0
    torch.testing.assert_close(run().float(), (x.float() @ weight.float().T), rtol=2e-2,
                               atol=2e-2)

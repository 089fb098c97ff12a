"""The CPU kernels on ARM, with no ARM machine at hand: build.py builds them with an aarch64
cross compiler as it would on an ARM host (its flags accepted there), and cross_check.cpp runs
them under qemu-user. Their plain C++ paths must give what the same paths give built for
baseline x86-64, which test_cpu_kernels.py holds to torch. Skipped without the cross tools
(`apt install g++-aarch64-linux-gnu qemu-user`)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from parashift.kernels.cpu import build as kernel_build

from kernel_tests.builds import load_for

CROSS, QEMU, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu"
ARM_MARCH = "armv8.4-a+sve+bf16"  # a Neoverse V1 (Graviton 3): SVE for GCC's vectorizer
HARNESS = os.path.join(os.path.dirname(__file__), "cross_check.cpp")
KERNELS = os.path.dirname(kernel_build.__file__)
EM_AARCH64 = 183


def _outputs(compiler: str, library_path: str, exe: str, runner: list[str]) -> list[list[str]]:
    subprocess.run([compiler, "-O1", "-std=c++17", "-fopenmp", f"-I{KERNELS}", HARNESS,
                    library_path, "-o", exe], check=True, capture_output=True, text=True)
    done = subprocess.run([*runner, exe], check=True, capture_output=True, text=True, timeout=300)
    return [line.split() for line in done.stdout.splitlines()]


def test_arm_builds_give_the_x86_64_builds_numbers(tmp_path, tmp_path_factory, monkeypatch):
    cross, qemu = shutil.which(CROSS), shutil.which(QEMU)
    if cross is None or qemu is None or not os.path.isdir(SYSROOT):
        pytest.skip(f"needs {CROSS} and {QEMU} (apt install g++-aarch64-linux-gnu qemu-user)")
    x86 = load_for("x86-64", tmp_path_factory).path
    with monkeypatch.context() as m:  # build.py on an ARM host, its compiler this one
        m.setattr(kernel_build.platform, "machine", lambda: "aarch64")
        m.setattr(kernel_build.shutil, "which", lambda name: cross)
        arm = kernel_build.build(str(tmp_path), ARM_MARCH)
    with open(arm, "rb") as f:
        header = f.read(20)
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == EM_AARCH64

    want = _outputs(shutil.which("g++") or "c++", x86, str(tmp_path / "x86"), [])
    got = _outputs(cross, arm, str(tmp_path / "arm"), [qemu, "-L", SYSROOT])
    assert len(got) == len(want) > 20_000
    kernels = set()
    for (label, dtype, value), (want_label, want_dtype, want_value) in zip(got, want,
                                                                            strict=True):
        assert (label, dtype) == (want_label, want_dtype)
        kernels.add(label)
        if label == "argmax":
            assert value == want_value
        else:  # sums in other orders: fp32 to rounding, bf16 within one step
            rtol, atol = (1e-4, 1e-6) if dtype == "0" else (2**-8, 1e-3)
            assert float(value) == pytest.approx(float(want_value), rel=rtol, abs=atol), label
    assert kernels == {"rms_norm", "rms_norm_sum", "silu_and_mul", "rotary", "decode_attention",
                       "argmax"}

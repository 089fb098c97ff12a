"""The CPU kernels built for older x86 CPUs than this one, where this one can run their code:
what other machines take (the FMA GEMM, decode attention on AVX2, and with -march=x86-64 the
plain C++ paths that ARM builds too) is checked here too. Each target is built once a session."""

from __future__ import annotations

import pytest
from parashift.kernels.cpu import library

# -march targets and the instruction sets (as /proc/cpuinfo names them) their code needs
MARCHES = {"native": set(),
           "x86-64": {"sse2"},
           "haswell": {"avx2", "fma", "bmi2", "f16c", "movbe"},
           "skylake-avx512": {"avx2", "fma", "bmi2", "f16c", "movbe", "avx512f", "avx512bw",
                              "avx512vl", "avx512dq", "avx512cd"},
           # AVX512-BF16 without AMX: the vdpbf16ps paths, even on a CPU with AMX
           "cooperlake": {"avx2", "fma", "bmi2", "f16c", "movbe", "avx512f", "avx512bw",
                          "avx512vl", "avx512dq", "avx512cd", "avx512_vnni", "avx512_bf16"}}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split()[2:]}
    except OSError:
        return set()


def load_for(march: str, tmp_path_factory: pytest.TempPathFactory) -> library.CpuOps:
    """The kernels built for `march` (skips where this CPU cannot run them)."""
    if not MARCHES[march] <= cpu_flags():
        pytest.skip(f"this CPU cannot run code built for -march={march}")
    build_dir = tmp_path_factory.getbasetemp() / f"cpu-kernels-{march}"
    return library.load(str(build_dir), None if march == "native" else march)

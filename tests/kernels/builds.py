"""The CPU kernels built for older x86 CPUs than this one, where this one can run their code:
what other machines take (the FMA GEMM, decode attention on AVX2) is checked here too."""

from __future__ import annotations

import pytest
from parashift.kernels.cpu import library

# -march targets and the instruction sets (as /proc/cpuinfo names them) their code needs
MARCHES = {"native": set(),
           "haswell": {"avx2", "fma", "bmi2", "f16c", "movbe"},
           "skylake-avx512": {"avx2", "fma", "bmi2", "f16c", "movbe", "avx512f", "avx512bw",
                              "avx512vl", "avx512dq", "avx512cd"}}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {flag for line in f if line.startswith("flags") for flag in line.split()[2:]}
    except OSError:
        return set()


def load_for(march: str, build_dir: str) -> library.CpuOps:
    """The kernels built for `march` (skips where this CPU cannot run them)."""
    if not MARCHES[march] <= cpu_flags():
        pytest.skip(f"this CPU cannot run code built for -march={march}")
    return library.load(build_dir, None if march == "native" else march)

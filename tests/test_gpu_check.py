"""scripts/gpu_check.sh: it parses, and on a machine without a GPU (CI) it says so and exits 2
without touching anything; scripts/bench_kernels.py refuses to time the interpreter."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"


def test_the_scripts_parse():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    subprocess.run(["bash", "-n", str(SCRIPT.with_name("gpu_carry.sh"))], check=True)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU may be here")
def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "no NVIDIA GPU is visible" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU may be here")
def test_bench_kernels_needs_a_gpu():
    done = subprocess.run([sys.executable, str(SCRIPT.with_name("bench_kernels.py"))],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "bench_kernels.py needs a CUDA GPU" in done.stderr

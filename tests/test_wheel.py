"""parashift as a wheel, not the editable checkout: built from the tree, installed into a fresh
venv (its dependencies reached through a path entry to this environment's site-packages, so
nothing is downloaded, while this checkout's editable hook is never run there), it generates
with a tiny model, and the CPU kernels compile from the wheel's own sources (a fresh cache
folder) and pass their tests."""

from __future__ import annotations

import glob
import os
import site
import subprocess
import sys
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-w", str(out), ROOT],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = glob.glob(str(out / "parashift-*.whl"))
    env_dir = out / "venv"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    target = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path("
                             "'purelib'))"], capture_output=True, text=True, check=True)
    purelib = target.stdout.strip()
    with open(os.path.join(purelib, "dependencies.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                                "--target", purelib, wheel],
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    return python


def _run(python: str, args: list[str], cache: str, cwd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PARASHIFT_CACHE_DIR"] = cache
    return subprocess.run([python, *args], capture_output=True, text=True, timeout=900, env=env,
                          cwd=cwd)


def test_the_wheel_generates(wheel_python, tiny_llama, tmp_path):
    code = ("import parashift, sys\n"
            "from parashift import LLM, SamplingParams\n"
            "print(parashift.__file__)\n"
            f"llm = LLM({tiny_llama!r}, dtype='float32', max_model_len=128, "
            "kv_cache_memory=8 << 20)\n"
            "out = llm.generate([[5, 9, 100, 42]], SamplingParams(max_tokens=6, "
            "temperature=0, ignore_eos=True), use_tqdm=False)\n"
            "llm.shutdown()\n"
            "print(len(out[0].outputs[0].token_ids))\n")
    done = _run(wheel_python, ["-c", code], str(tmp_path / "cache"), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    where, count = done.stdout.split()[-2:]
    assert where.startswith(os.path.dirname(os.path.dirname(wheel_python)))  # not the tree
    assert count == "6"


def test_the_cpu_kernels_build_from_the_wheel_and_pass(wheel_python, tmp_path):
    cache = tmp_path / "cache"
    kernel_tests = os.path.join(ROOT, "tests", "kernel_tests")
    done = _run(wheel_python, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                               *(os.path.join(kernel_tests, name) for name in (
                                   "test_cpu_kernels.py", "test_cpu_attention_backend.py",
                                   "test_cpu_kernel_build.py", "test_cpu_build_key.py"))],
                str(cache), str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
    built = glob.glob(str(cache / "**" / "cpu-ops-*.so"), recursive=True)
    assert built, "the kernels were not compiled into the fresh cache"

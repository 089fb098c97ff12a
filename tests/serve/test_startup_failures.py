"""Every way a launch can fail before it serves ends the same way: one error line that names
the cause and the flag, a non-zero exit within the deadline, and nothing left behind (no
process of the launch, no ipc folder, no shared-memory segment)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from safetensors.torch import load_file, save_file

from .conftest import TINY_ARGS, free_port, wait_gone

DEADLINE = 90.0  # seconds a failing launch may take, start-up timeouts included


def _snapshot() -> tuple[set[str], set[str]]:
    ipc = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("parashift-")}
    return ipc, set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def failed_launch(model: str, *flags: str, deadline: float = DEADLINE) -> str:
    """Runs `parashift run MODEL FLAGS`, which must fail; returns its output after checking
    the exit code, the time and the leftovers."""
    before = _snapshot()
    cmd = [sys.executable, "-m", "parashift.cli", "run", model, "--host", "127.0.0.1", *flags]
    if "--port" not in flags:
        cmd += ["--port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=env)
    seen: dict[int, psutil.Process] = {}
    while proc.poll() is None and time.monotonic() - start < deadline:
        try:
            for p in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.1)
    if proc.poll() is None:
        for p in [*seen.values(), psutil.Process(proc.pid)]:
            p.kill()
        pytest.fail(f"`{' '.join(cmd)}` still ran after {deadline:.0f} s:\n"
                    f"{proc.communicate()[0]}")
    output = proc.communicate()[0]
    assert proc.returncode != 0, output
    survivors = wait_gone(list(seen.values()), 10)
    assert not survivors, f"left running: {survivors}\n{output}"
    ipc, shm = _snapshot()
    assert ipc <= before[0], f"ipc folders left: {ipc - before[0]}"
    assert shm <= before[1], f"shared memory left: {shm - before[1]}"
    errors = [line for line in output.splitlines() if "ERROR" in line or "error:" in line]
    assert errors, output
    return output


def test_port_in_use(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = failed_launch(tiny_llama, *TINY_ARGS, "--port", str(port))
    assert f"--port {port}" in out and "in use" in out, out


def test_bad_model_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    out = failed_launch(missing, *TINY_ARGS)
    assert missing in out and "MODEL" in out, out


def _copy(model: str, tmp_path, name: str) -> str:
    folder = tmp_path / name
    shutil.copytree(model, folder)
    return str(folder)


def test_corrupt_safetensors(tiny_llama, tmp_path):
    model = _copy(tiny_llama, tmp_path, "corrupt")
    with open(os.path.join(model, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 64)  # the header length and the start of the header
    out = failed_launch(model, *TINY_ARGS)
    assert "model.safetensors" in out and "MODEL" in out, out


def test_corrupt_gguf(tmp_path):
    model = tmp_path / "broken.gguf"
    model.write_bytes(b"GGUF" + os.urandom(256))
    out = failed_launch(str(model), *TINY_ARGS)
    assert "broken.gguf" in out and "MODEL" in out, out


def test_kv_cache_that_does_not_fit(tiny_llama):
    out = failed_launch(tiny_llama, "--dtype", "float32", "--max-model-len", "256",
                        "--kv-cache-memory", "4KiB")
    assert "--kv-cache-memory" in out, out


def test_engine_that_crashes_during_load(tiny_llama, tmp_path):
    model = _copy(tiny_llama, tmp_path, "wrong-shapes")
    path = os.path.join(model, "model.safetensors")
    tensors = load_file(path)
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[name] = tensors[name][:-1]  # one row short: the engine fails while loading
    save_file(tensors, path, metadata={"format": "pt"})
    out = failed_launch(model, *TINY_ARGS)
    assert "dp0" in out and name in out, out


def test_worker_that_hangs_during_load(tiny_llama, tmp_path):
    model = _copy(tiny_llama, tmp_path, "hangs")
    path = os.path.join(model, "model.safetensors")
    os.remove(path)
    os.mkfifo(path)  # opening it blocks until a writer comes: a load that never ends
    start = time.monotonic()
    out = failed_launch(model, *TINY_ARGS, "--startup-timeout", "15")
    assert "--startup-timeout" in out and "dp0" in out, out
    assert time.monotonic() - start < 15 + 30

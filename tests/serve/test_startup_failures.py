"""Every way a launch can fail before it serves ends the same way: one error line that names
the cause and the flag, a non-zero exit within the deadline, and nothing left behind (no
process of the launch, no ipc folder, no shared-memory segment). The seven launches run at
once (one fixture), each test reads its own."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

import psutil
import pytest
from safetensors.torch import load_file, save_file

from .servers import TINY_ARGS, wait_gone

DEADLINE = 120.0  # seconds a failing launch may take, start-up timeouts included
HANG_TIMEOUT = 8  # --startup-timeout of the launch whose load never ends


@dataclass
class Launch:
    returncode: int | None
    output: str
    seconds: float
    survivors: list = field(default_factory=list)


def _snapshot() -> tuple[set[str], set[str]]:
    ipc = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith("parashift-")}
    return ipc, set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _launch(model: str, flags: list[str]) -> Launch:
    cmd = [sys.executable, "-m", "parashift.cli", "run", model, "--host", "127.0.0.1", *flags]
    if "--port" not in flags:
        cmd += ["--port", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=env)
    seen: dict[int, psutil.Process] = {}
    while proc.poll() is None and time.monotonic() - start < DEADLINE:
        try:
            for p in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.1)
    if proc.poll() is None:
        for p in [*seen.values(), psutil.Process(proc.pid)]:
            p.kill()
    output = proc.communicate()[0]
    return Launch(proc.returncode, output, time.monotonic() - start,
                  wait_gone(list(seen.values()), 10))


def _copy(model: str, root, name: str) -> str:
    folder = root / name
    shutil.copytree(model, folder)
    return str(folder)


@pytest.fixture(scope="module")
def launches(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("startup-failures")
    corrupt = _copy(tiny_llama, root, "corrupt")
    with open(os.path.join(corrupt, "model.safetensors"), "r+b") as f:
        f.write(b"\xff" * 64)  # the header length and the start of the header
    gguf = root / "broken.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(256))
    wrong = _copy(tiny_llama, root, "wrong-shapes")
    tensors = load_file(os.path.join(wrong, "model.safetensors"))
    wrong_name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[wrong_name] = tensors[wrong_name][:-1]  # one row short: the load fails
    save_file(tensors, os.path.join(wrong, "model.safetensors"), metadata={"format": "pt"})
    hangs = _copy(tiny_llama, root, "hangs")
    os.remove(os.path.join(hangs, "model.safetensors"))
    os.mkfifo(os.path.join(hangs, "model.safetensors"))  # opening it blocks: a load that hangs
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    cases = {
        "port": (tiny_llama, [*TINY_ARGS, "--port", str(port)]),
        "path": (str(root / "no-such-model"), TINY_ARGS),
        "safetensors": (corrupt, TINY_ARGS),
        "gguf": (str(gguf), TINY_ARGS),
        "kv": (tiny_llama, ["--dtype", "float32", "--max-model-len", "256",
                            "--kv-cache-memory", "4KiB"]),
        "crash": (wrong, TINY_ARGS),
        "hang": (hangs, [*TINY_ARGS, "--startup-timeout", str(HANG_TIMEOUT)]),
    }
    before = _snapshot()
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {name: pool.submit(_launch, *case) for name, case in cases.items()}
        results = {name: f.result() for name, f in futures.items()}
    taken.close()
    after = _snapshot()
    return {"results": results, "port": port, "root": root, "wrong_name": wrong_name,
            "left": (after[0] - before[0], after[1] - before[1])}


def failed(launches, name: str) -> str:
    launch = launches["results"][name]
    assert launch.returncode not in (0, None), launch.output
    assert launch.seconds < DEADLINE and not launch.survivors, (launch.survivors,
                                                                launch.output)
    errors = [line for line in launch.output.splitlines()
              if "ERROR" in line or "error:" in line]
    assert errors, launch.output
    return launch.output


def test_nothing_is_left_behind(launches):
    ipc, shm = launches["left"]
    assert not ipc, f"ipc folders left: {ipc}"
    assert not shm, f"shared memory left: {shm}"


def test_port_in_use(launches):
    out = failed(launches, "port")
    assert f"--port {launches['port']}" in out and "in use" in out, out


def test_bad_model_path(launches):
    out = failed(launches, "path")
    assert str(launches["root"] / "no-such-model") in out and "MODEL" in out, out


def test_corrupt_safetensors(launches):
    out = failed(launches, "safetensors")
    assert "model.safetensors" in out and "MODEL" in out, out


def test_corrupt_gguf(launches):
    out = failed(launches, "gguf")
    assert "broken.gguf" in out and "MODEL" in out, out


def test_kv_cache_that_does_not_fit(launches):
    assert "--kv-cache-memory" in failed(launches, "kv")


def test_engine_that_crashes_during_load(launches):
    out = failed(launches, "crash")
    assert "dp0" in out and launches["wrong_name"] in out, out


def test_worker_that_hangs_during_load(launches):
    """The launcher gives up --startup-timeout after it started (its own log's clock: seven
    launches importing torch at once on two cores take long to get there), and its stop of
    the hung engine is short."""
    out = failed(launches, "hang")
    assert "--startup-timeout" in out and "dp0" in out, out
    stamps = [datetime.strptime(line[:8], "%H:%M:%S") for line in out.splitlines()
              if re.match(r"\d\d:\d\d:\d\d ", line)]
    assert (stamps[-1] - stamps[0]).seconds <= HANG_TIMEOUT + 10, out

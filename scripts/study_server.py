"""A `parashift run` server as a child process, for the bench commands that start their own
(dp-scaling, serving-vs-offline, backends), and the whole-workload HTTP run they time. The
server is started through the command line, never imported: bench sits beside the HTTP layer,
not above it."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

from parashift.bench.datasets import BenchRequest
from parashift.bench.metrics import RequestRecord

SERVING = re.compile(r"is serving .* at (http://\S+)/v1\s*$")


@dataclass
class ServerProcess:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    startup_s: float = 0.0  # the command to its "is serving" line
    lines: list[str] = field(default_factory=list)  # its output so far


def process_tree(pid: int) -> list[int]:
    """The pid and all its descendants' (Linux /proc): a server's processes."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, stack = [], [pid]
    while stack:
        p = stack.pop()
        tree.append(p)
        stack += children.get(p, [])
    return tree


def process_title(pid: int) -> str:
    """What `ps` shows as its command (parashift-engine-dp0, ...); '' once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


@contextlib.contextmanager
def running_server(model: str | None, run_args: list[str], env: dict[str, str] | None = None,
                   timeout: float = 600.0) -> Iterator[ServerProcess]:
    """`parashift run [MODEL] RUN_ARGS` on a port of the kernel's choice until the block ends
    (SIGTERM)."""
    server = start_server(model, run_args, env, timeout)
    try:
        yield server
    finally:
        stop_server(server)


def start_server(model: str | None, run_args: list[str], env: dict[str, str] | None = None,
                 timeout: float = 600.0) -> ServerProcess:
    # --port 0: the server binds a port the kernel picks and names it in its banner. Admin
    # routes on: studies empty the prefix cache between runs (reset_prefix_cache).
    cmd = [sys.executable, "-m", "parashift.cli", "run", *([model] if model else []),
           "--host", "127.0.0.1", "--port", "0", "--enable-admin-routes", *run_args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,  # nosec B603
                            stderr=subprocess.STDOUT, text=True, errors="replace",
                            env={**os.environ, **(env or {})})
    server = ServerProcess("", proc)
    serving = threading.Event()

    def drain() -> None:  # keeps reading so that the server never blocks on a full pipe
        for line in proc.stdout:
            server.lines.append(line)
            banner = None if serving.is_set() else SERVING.search(line)
            if banner:
                server.url = banner[1]
                server.startup_s = time.perf_counter() - start
                serving.set()
            elif serving.is_set() and ("WARNING" in line or "ERROR" in line):
                print("server:", line, end="", flush=True)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not serving.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            why = (f"exited with code {proc.returncode}" if proc.poll() is not None
                   else f"did not print 'is serving' within {timeout:.0f} s")
            stop_server(server)
            tail = "".join(server.lines[-40:])
            raise RuntimeError(f"`parashift run {' '.join(cmd[4:])}` {why}:\n{tail}")
    # "is serving" can come just before the API server hears that the engines are ready.
    while _status(server.url + "/health") != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"the server at {server.url} never became healthy")
        time.sleep(0.05)
    return server


def stop_server(server: ServerProcess, timeout: float = 60.0) -> None:
    """SIGTERM (the launcher stops its engines), then SIGKILL if it does not exit."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)


def _status(url: str, method: str = "GET") -> int:
    try:
        request = urllib.request.Request(url, method=method)
        with urllib.request.urlopen(request, timeout=30) as r:  # nosec B310
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def reset_prefix_cache(url: str) -> None:
    """So that a repeat does not hit the previous run's cached prompts."""
    status = _status(url + "/reset_prefix_cache", "POST")
    if status != 200:
        raise RuntimeError(f"POST {url}/reset_prefix_cache answered {status}")


def send_all(url: str, requests: list[BenchRequest]) -> tuple[float, list[RequestRecord]]:
    """Every request at once, streaming; the seconds until the last one finished, and their
    records. A failed request stops the measurement: its time would not mean anything."""
    from parashift.bench.serve_client import run_load

    records, elapsed = asyncio.run(run_load(url, None, requests, math.inf))
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(records)} requests to {url} failed, "
                           f"first: {failed[0]}")
    return elapsed, records


def warm_up(url: str, vocab_size: int) -> None:
    """Two short requests (first-call costs out of the timed runs), then a clean cache."""
    from parashift.bench.datasets import random_requests

    send_all(url, random_requests(2, (16, 16), (4, 4), vocab_size, 1))
    reset_prefix_cache(url)

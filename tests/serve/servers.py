"""Real `parashift run` servers for the end-to-end tests: a subprocess on a free port, ready once
it prints "is serving", always torn down (SIGTERM, then SIGKILL of whatever is left of its
process tree), with a check that no process of the tree survives."""

from __future__ import annotations

import contextlib
import json
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
from typing import Any

import psutil
import pytest

STARTUP_TIMEOUT = 120.0  # seconds until "is serving"; a tiny model needs ~10 s here
SHUTDOWN_TIMEOUT = 10.0  # --shutdown-timeout of every test server (the default)
# The launcher waits up to shutdown + 5 s for the API servers and 10 s for the engines.
EXIT_TIMEOUT = SHUTDOWN_TIMEOUT + 20.0
TINY_MAX_MODEL_LEN = 256
# A small KV cache: the default budget makes the engine allocate GiBs and start slower.
TINY_ARGS = ["--dtype", "float32", "--max-model-len", str(TINY_MAX_MODEL_LEN),
             "--kv-cache-memory", "32MiB"]
# The tiny model makes ~650 tokens/s here, so a request within 256 tokens is over in 0.4 s.
# Tests that must catch a request in flight (client disconnect, engine killed) use the same
# weights with a long context: 8000 tokens take ~20 s, far longer than those tests wait.
LONG_MAX_MODEL_LEN = 8192
LONG_ARGS = ["--dtype", "float32", "--max-model-len", str(LONG_MAX_MODEL_LEN),
             "--kv-cache-memory", "32MiB"]


def http_request(method: str, url: str, body: Any = None,
                 headers: dict[str, str] | None = None, timeout: float = 30.0
                 ) -> tuple[int, bytes]:
    """Status and body of one plain HTTP call (an HTTP error is an answer, not an exception)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def live(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running; a zombie has exited (and pid 1 here may never reap orphans)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def fork_server_folder(tree: list[psutil.Process]) -> str:
    """The folder multiprocessing made for a launch's fork server socket (/tmp/pymp-*)."""
    server = next(p for p in tree if p.name() == "parashift-forks"
                  or "parashift-forkserver" in " ".join(p.cmdline()))
    listening = getattr(server, "net_connections", None) or server.connections
    paths = [c.laddr for c in listening(kind="unix") if "/pymp-" in c.laddr]
    assert len(paths) == 1, paths
    return os.path.dirname(paths[0])


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Waits until none of `procs` runs (zombies count as gone); returns those still alive."""
    deadline = time.monotonic() + timeout
    while (alive := live(procs)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT (no /v1)
    proc: subprocess.Popen
    model_name: str
    lines: list[str] = field(default_factory=list)  # stdout + stderr so far
    tree: list[psutil.Process] = field(default_factory=list)  # launcher + children at start
    health_at_start: tuple[int, bytes] = (0, b"")  # GET /health right after "is serving"
    cmd: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None  # appends to `lines` until the output ends

    def output(self) -> str:
        return "".join(self.lines)

    def wait_exit(self, timeout: float) -> int:
        """Its exit code, once every line it wrote is in `lines`."""
        code = self.proc.wait(timeout)
        if self.reader is not None:
            self.reader.join(timeout)
        return code

    def wait_line(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """The first line of its output that matches `pattern`, once there; AssertionError
        (with the output) if the process exits or `timeout` passes first."""
        deadline, last_look = time.monotonic() + timeout, False
        while True:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            if self.proc.poll() is not None:
                if not last_look and self.reader is not None:
                    self.reader.join(10)  # its last lines, then one more look
                    last_look = True
                    continue
                raise AssertionError(f"exited with code {self.proc.returncode} before a line "
                                     f"matching {pattern!r}; output:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s; "
                                     f"output:\n{self.output()}")
            time.sleep(0.05)

    def client(self, api_key: str = "unused", **kwargs: Any):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def async_client(self, api_key: str = "unused", **kwargs: Any):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                                  timeout=kwargs.pop("timeout", 60.0), **kwargs)

    def current_tree(self) -> list[psutil.Process]:
        """The launcher and all its descendants now, plus those seen at start-up."""
        procs = {p.pid: p for p in self.tree}
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                procs.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass
        return list(procs.values())

    def wildcard_listeners(self) -> list[tuple[str, int, str]]:
        """(address, port, process) of the tcp sockets that the server's processes listen on
        at every interface (0.0.0.0 or ::): none when each binds the interface it was given."""
        found = []
        for proc in live(self.current_tree()):
            with contextlib.suppress(psutil.Error):
                found += [(c.laddr.ip, c.laddr.port, proc.name())
                          for c in proc.net_connections(kind="tcp")
                          if c.status == psutil.CONN_LISTEN and c.laddr.ip in ("0.0.0.0", "::")]
        return found

    def engine_process(self, rank: int = 0) -> psutil.Process:
        name = f"parashift-engine-dp{rank}"
        for p in live(self.current_tree()):
            with contextlib.suppress(psutil.Error):
                if name in p.name() or name in " ".join(p.cmdline()):
                    return p
        raise AssertionError(f"no {name} process among the launcher's children:\n"
                             + self.output()[-4000:])

    # --- plain HTTP ---------------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None, timeout: float = 30.0
                ) -> tuple[int, bytes]:
        return http_request(method, self.url + path, body, headers, timeout)

    def get_json(self, path: str) -> tuple[int, Any]:
        status, raw = self.request("GET", path)
        return status, json.loads(raw)

    def metric(self, name: str, labels: str = "") -> float | None:
        """One sample of GET /metrics, e.g. metric("parashift_num_requests_running",
        'engine="dp0"'); None while the series does not exist."""
        status, raw = self.request("GET", "/metrics")
        assert status == 200, raw
        pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "")
        m = re.search(r"^" + pattern + r" (\S+)$", raw.decode(), re.MULTILINE)
        return None if m is None else float(m.group(1))


# The servers launched and not yet ended when the current test began, or since: a failing
# test's report carries the end of their output (conftest.py's report hook).
LAUNCHED: list[Server] = []
OUTPUT_IN_REPORT = 6000  # characters of each server's output


def launch(model: str, args: list[str], model_name: str | None = None,
           env: dict[str, str] | None = None) -> Server:
    """`parashift run` started (its output collected as it comes), not yet waited for. Its
    HTTP port is one the kernel picks (--port 0): its log names it, and `wait_serving` sets
    `url` from the banner. No test picks a port and releases it for a server to bind."""
    cmd = [sys.executable, "-m", "parashift.cli", "run", model, "--host", "127.0.0.1",
           "--port", "0", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", env=env)
    server = Server("", proc, model_name or os.path.basename(model.rstrip("/")))
    server.cmd = cmd
    LAUNCHED.append(server)

    def drain() -> None:  # keeps reading so that the child never blocks on a full pipe
        for line in proc.stdout:
            server.lines.append(line)

    server.reader = threading.Thread(target=drain, daemon=True)
    server.reader.start()
    return server


def wait_serving(server: Server) -> Server:
    """Until the banner ("is serving ... at URL"); the URL and process tree are then set."""
    try:
        server.url = server.wait_line(r"is serving .* at (http://\S+)/v1",
                                      STARTUP_TIMEOUT).group(1)
    except AssertionError as e:
        stop(server)
        pytest.fail(f"`{' '.join(server.cmd)}`: {e}")
    server.tree = [psutil.Process(server.proc.pid),
                   *psutil.Process(server.proc.pid).children(recursive=True)]
    # The API servers accept only once every engine is ready, and the URL is printed after
    # that: /health answers 200 at once (test_lifecycle.py checks this first answer).
    try:
        server.health_at_start = server.request("GET", "/health", timeout=60)
    except OSError as e:
        server.health_at_start = (0, repr(e).encode())
    return server


def holds_nothing(server: Server, *ranks: int, timeout: float = 30.0) -> None:
    """Waits until each of `ranks` holds no KV block and no request (its engine's load as
    /metrics shows it); fails naming the rank after `timeout`."""
    for rank in ranks:
        engine = f'engine="dp{rank}"'
        deadline = time.monotonic() + timeout
        while not all(server.metric(name, engine) == 0.0 for name in (
                "parashift_kv_cache_usage_ratio", "parashift_num_requests_running",
                "parashift_num_requests_waiting")):
            assert time.monotonic() < deadline, (
                f"dp{rank} still holds KV blocks or requests:\n{server.output()[-3000:]}")
            time.sleep(0.05)


def stop(server: Server) -> int | None:
    """SIGTERM, wait, then SIGKILL whatever is left of the tree; asserts nothing survives.
    Returns the launcher's exit code (None if it had to be killed)."""
    proc = server.proc
    tree = server.current_tree()
    code = proc.poll()
    if code is None:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
    # The fork server ends just after the launcher, once its pipe closes, and removes its
    # socket's folder then: killed, it could not.
    leftovers = wait_gone(tree, 5) if code is not None else live(tree)
    for p in leftovers:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    survivors = wait_gone(tree, 10)
    assert not survivors, f"processes left after stopping the server: {survivors}"
    return code


@contextlib.contextmanager
def running_server(model: str, *args: str, model_name: str | None = None,
                   env: dict[str, str] | None = None) -> Iterator[Server]:
    server = wait_serving(launch(model, list(args), model_name, env))
    try:
        yield server
    finally:
        stop(server)

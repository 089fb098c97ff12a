"""`parashift run --strategy dp2xtp2`: two engines, each split over two worker processes with
a real gloo group, behind one endpoint."""

from __future__ import annotations

import contextlib
import signal
import time

import psutil
import pytest

from .servers import TINY_ARGS, live, running_server
from .test_data_parallel import PROMPTS, ask_all, complete, greedy_texts

pytestmark = pytest.mark.slow


def worker(server, dp: int, *coords: str) -> psutil.Process:
    """The worker process of engine `dp` at `coords` (e.g. "pp1", "tp0")."""
    name = "-".join([f"parashift-worker-dp{dp}", *coords])
    for proc in live(server.current_tree()):
        with contextlib.suppress(psutil.Error):
            if name in proc.name() or name in " ".join(proc.cmdline()):
                return proc
    raise AssertionError(f"no {name} process:\n" + server.output()[-3000:])


def test_dp2xtp2_serves_like_dp1_and_a_dead_worker_takes_only_its_rank(tiny_llama):
    expected = greedy_texts(tiny_llama)
    with running_server(tiny_llama, *TINY_ARGS, "--strategy", "dp2xtp2") as s:
        workers = {(d, t): worker(s, d, f"tp{t}") for d in (0, 1) for t in (0, 1)}
        assert len({w.pid for w in workers.values()}) == 4
        assert ask_all(s) == expected

        workers[(1, 1)].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 15
        while s.get_json("/health")[0] != 503:
            assert time.monotonic() < deadline, "the dead worker went unnoticed:\n" + s.output()
            time.sleep(0.1)
        assert "dp1" in s.get_json("/health")[1]["detail"]
        assert "worker parashift-worker-dp1-tp1 exited" in s.output()
        for prompt, want in zip(PROMPTS[:6], expected[:6], strict=True):  # dp0 serves on
            assert complete(s, prompt)["choices"][0]["text"] == want
        # The dead rank's engine and its other worker are gone; dp0's workers are not.
        deadline = time.monotonic() + 15
        while live([workers[(1, 0)]]):
            assert time.monotonic() < deadline, "dp1's other worker outlived its engine"
            time.sleep(0.1)
        assert len(live([workers[(0, 0)], workers[(0, 1)]])) == 2

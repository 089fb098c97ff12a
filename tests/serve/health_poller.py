"""A thread that asks a server's /health every 0.1 s while a test's request runs, and the time
each answer took as the poller measured it: a request whose work runs on the event loop shows
as a slow answer (issue 52 bounds each at 1 s)."""

from __future__ import annotations

import threading
import time
from typing import Any


class HealthPoller:
    def __init__(self, server: Any, period: float = 0.1):
        self.server = server
        self.period = period
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _poll(self) -> None:
        while True:
            start = time.perf_counter()
            status, _ = self.server.request("GET", "/health", timeout=30)
            self.latencies.append(time.perf_counter() - start)
            self.statuses.append(status)
            if self._stop.wait(self.period):
                return

    def assert_responsive(self, bound: float = 1.0) -> None:
        assert self.latencies, "the poller never got an answer"
        assert set(self.statuses) == {200}, self.statuses
        assert max(self.latencies) < bound, f"slowest /health {max(self.latencies):.2f} s"

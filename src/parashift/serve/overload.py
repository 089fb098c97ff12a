"""Overload. A request a full rank refused tries the least loaded live rank that has not refused
it (the engine client's pick_engine, serve/generation.py). When every live rank has refused
it, it waits here, in arrival order and at most as long as the queues take to drain, for one
of this API server's requests to finish (a slot on that rank) and tries again: this server
hears of the finish before that request's client can send its next one, so a refused request
is not starved by clients that resubmit at once. Then the client gets a 429 that says when to
come back (Retry-After), estimated from how fast this server sees requests finish."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from parashift.serve.openai_protocol import OpenAIError

RETRY_AFTER_UNKNOWN_S = 1.0  # no finish seen lately to estimate from
RETRY_AFTER_MIN_S = 0.1  # sooner, a retry would likely find the queue as it left it
RETRY_AFTER_MAX_S = 60.0  # the openai client honours up to 120 s; beyond, it backs off itself


class DrainRate:
    """Requests finished per second, over the last `window` finishes within `horizon_s`: a
    rank that stops finishing decays to no estimate instead of keeping an old rate."""

    def __init__(self, window: int = 64, horizon_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.horizon_s = horizon_s
        self.clock = clock
        self._finished_at: deque[float] = deque(maxlen=window)

    def on_finished(self, count: int = 1) -> None:
        now = self.clock()
        self._finished_at.extend([now] * count)

    def per_second(self) -> float | None:
        now = self.clock()
        while self._finished_at and now - self._finished_at[0] > self.horizon_s:
            self._finished_at.popleft()
        if len(self._finished_at) < 2:
            return None
        span = now - self._finished_at[0]  # to now: a pause since the last finish slows it
        return len(self._finished_at) / span if span > 0 else None


class RoomWaiters:
    """Requests every live rank refused, waiting in arrival order: each finish of one of this
    server's requests wakes the first of them."""

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def on_finished(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # else it timed out or its client left
                waiter.set_result(None)
                return

    async def wait(self, timeout: float) -> bool:
        """Whether a finish woke it within `timeout` seconds."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)


def retry_after(backlog: int, rate: float | None) -> float:
    """Seconds until `backlog` requests ahead of a new one have finished at `rate` per second:
    by then the queues that refused it have room (they hold at most that backlog)."""
    if rate is None:
        return RETRY_AFTER_UNKNOWN_S
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, backlog / rate))


class RetryLaterError(OpenAIError):
    """A 429 that says when to retry: serve/http_guards.py sends `retry_after` as Retry-After
    (whole seconds) and retry-after-ms, which the openai clients prefer (waits under 1 s)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(429, message, "rate_limit_error")
        self.retry_after = retry_after

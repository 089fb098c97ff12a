"""Overload. A request a full rank refused tries the least loaded live rank that has not refused
it (the engine client's pick_engine, serve/generation.py). When every live rank has refused
it, it waits here, in arrival order and for at most HOLD_S, for a slot to free (one of this
API server's requests finishing, or a coordinator vector saying another server's did) and
tries again: this server hears of its own finishes before their clients can send their next
requests, so a refused request is not starved by clients that resubmit at once. A short
grace, not a second queue: past it the client gets a 429 that says when to come back
(Retry-After), estimated from how fast this server sees requests finish."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from parashift.serve.openai_protocol import OpenAIError

RETRY_AFTER_UNKNOWN_S = 1.0  # no finish seen lately to estimate from
HOLD_S = 1.0  # how long a request every live rank refused waits for room
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
    """Requests every live rank refused, waiting in arrival order to be woken when a slot
    frees: a finish of one of this server's requests, or a coordinator vector in which a rank
    holds fewer requests (another server's finished)."""

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def wake(self, count: int = 1) -> None:
        while count > 0 and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # else it timed out or its client left
                waiter.set_result(None)
                count -= 1

    async def wait(self, timeout: float, first: bool = False) -> bool:
        """Whether a slot freed within `timeout` seconds; `first`: woken before and beaten to
        that slot, it keeps its place at the head."""
        waiter = asyncio.get_running_loop().create_future()
        if first:
            self._waiters.appendleft(waiter)
        else:
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

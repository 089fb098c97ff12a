"""The work a request costs before any of its limits can be checked, bounded: its body read
within --max-body-size (413) and in time (serve/pacing.py: a 408 and the connection closed),
the tokenizer thread's queue per API server (a 429 with Retry-After beyond), and a chat's size
counted over every text it carries before anything decodes or renders it. The JSON body itself
is decoded on the event loop, bounded by --max-body-size only (read_body says why)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from parashift.serve.openai_protocol import ChatCompletionRequest, OpenAIError, parse
from parashift.serve.pacing import MIN_RATE, Pace

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)


async def read_body(request: web.Request, kind: type[S], idle_timeout: float) -> S:
    """The request's body as `kind`; a 400 naming the field where it does not fit.

    On the loop, not in a thread: msgspec holds the GIL for the whole of one decode, so a
    thread stalls the loop just as long (measured: 6 MiB of token ids, 178 ms decode, the
    loop's longest gap 178 ms in a thread, 169 ms inline). The stall grows with the number
    of JSON values, at most some millions under the 8 MiB body cap; a real bound needs the
    decode in another process with a cheaper hand-back, or a smaller cap."""
    return parse(await _read(request, idle_timeout), kind)  # type: ignore[return-value]


async def _read(request: web.Request, idle_timeout: float) -> bytes:
    """The body, chunk by chunk as aiohttp's request.read() does, each wait paced: aiohttp's
    own timers end with the request's head (keep-alive), and a body trickled or stalled would
    hold a connection and what it sent so far for ever."""
    limit = request.client_max_size
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(limit, request.content_length)
    body, pace = bytearray(), Pace(idle_timeout)
    while True:
        try:
            async with asyncio.timeout(pace.timeout()):
                chunk = await request.content.readany()
        except TimeoutError:
            # Closed after the 408 (and aiohttp's lingering read, at most 10 s), not kept.
            request.protocol.close()
            raise OpenAIError(408, f"the request body did not arrive in time (nothing for "
                              f"--stream-idle-timeout, {idle_timeout:g} s, or under "
                              f"{MIN_RATE >> 10} KiB/s on average)", "timeout") from None
        if not chunk:
            return bytes(body)
        body += chunk
        pace.moved(len(chunk))
        if len(body) > limit:
            raise web.HTTPRequestEntityTooLarge(limit, len(body))


class QueueFullError(OpenAIError):
    """A 429 whose `retry_after` (seconds) serve/http_guards.py sends as Retry-After."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(429, message, "rate_limit_error", code="tokenizer_queue_full")
        self.retry_after = retry_after


class BoundedPool:
    """One thread (a tokenizer is not shared between threads) holding at most `max_tasks`
    tasks, queued or running: one client's large bodies cannot grow a queue every other
    request of this API server waits behind. Past the bound, QueueFullError with a
    Retry-After from the tasks ahead and their mean time."""

    def __init__(self, max_tasks: int, thread_name: str):
        self.max_tasks = max_tasks
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self.num_tasks = 0
        self.mean_task_s = 0.01  # moving average of a task's time, for Retry-After
        self._lock = threading.Lock()  # num_tasks drops in the worker (or a cancelling) thread

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            if self.num_tasks >= self.max_tasks:
                wait_s = self.num_tasks * self.mean_task_s
                raise QueueFullError(f"the tokenizer queue of this API server is full "
                                     f"({self.max_tasks} requests)", wait_s)
            self.num_tasks += 1
        future = self.executor.submit(self._timed, fn, *args)
        future.add_done_callback(self._done)  # a cancelled wait leaves the task counted
        return await asyncio.wrap_future(future)

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.mean_task_s += 0.2 * (time.perf_counter() - start - self.mean_task_s)

    def _done(self, future: Future) -> None:
        with self._lock:
            self.num_tasks -= 1


def chat_chars(req: ChatCompletionRequest) -> int:
    """Characters of every text a chat carries into its template: contents (and their
    parts), names, refusals, tool calls' ids, names and arguments, tool results' call ids."""
    total = 0
    for m in req.messages:
        texts = [m.role, m.name, m.refusal, m.tool_call_id]
        if isinstance(m.content, str):
            texts.append(m.content)
        else:
            for part in m.content or ():
                texts += [part.type, part.text, part.refusal]
        for call in m.tool_calls or ():
            texts += [call.id, call.function.name, call.function.arguments]
        total += sum(len(t) for t in texts if t)
    return total

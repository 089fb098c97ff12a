"""A streamed generation as server-sent events, and how the stream ended: the headers go out
with the first delta, or after ADMISSION_WAIT_S without one, so a refusal is an HTTP error and
every end after them (done, timed out, engine dead, a bug) is an event, then `[DONE]`; a
client that left gets nothing more. A client that reads nothing for
--stream-idle-timeout seconds (a write that cannot drain that long: aiohttp's write waits once
the transport's buffer is past its high-water mark) is dropped, and its request aborted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from parashift.serve import responses
from parashift.serve.engine_errors import EngineDeadError
from parashift.serve.generation import Generation
from parashift.serve.http_guards import internal_error, request_key
from parashift.serve.openai_protocol import OpenAIError
from parashift.serve.overload import HOLD_S
from parashift.serve.pacing import small_send_buffer

CLIENT_LEFT = request_key("parashift.client_left", bool)  # the client went away mid-stream
ADMISSION_WAIT_S = HOLD_S + 0.5  # a refusal's 429 comes within this (its wait for room)


class ClientStalledError(Exception):
    """A write did not drain within --stream-idle-timeout: the client is reading nothing."""


def timed_out(timeout: float | None, flag: str = "--request-timeout") -> OpenAIError:
    return OpenAIError(504, f"the request took longer than {flag} ({timeout:g} s) and was "
                       "aborted", "timeout")


def non_stream_limit(request_timeout: float | None,
                     non_stream_timeout: float) -> tuple[float, str]:
    """Seconds a request that is not streamed may take, and the flag that says so: the shorter
    of --request-timeout (when given: it bounds streams too) and --non-stream-timeout."""
    if request_timeout is not None and request_timeout <= non_stream_timeout:
        return request_timeout, "--request-timeout"
    return non_stream_timeout, "--non-stream-timeout"


async def stream(request: web.Request, gen: Generation, formatter: responses.Formatter,
                 timeout: float | None,
                 idle_timeout: float | None = None) -> tuple[web.StreamResponse, str]:
    """The SSE response and how it ended: ok, timeout or error (an event says which),
    disconnected (the client left) or idle (it read nothing for `idle_timeout` seconds and was
    dropped); for the last two `request[CLIENT_LEFT]` is set. The headers wait for the first
    delta up to ADMISSION_WAIT_S: a refusal (a 429 with Retry-After, a 400) comes within it
    and is then a plain HTTP error, which a client can retry."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    deltas = gen.stream()
    first = asyncio.ensure_future(anext(deltas, None))
    try:
        await asyncio.wait({first}, timeout=min(ADMISSION_WAIT_S, timeout or ADMISSION_WAIT_S))
        if first.done() and isinstance(first.exception(), OpenAIError | EngineDeadError):
            raise first.exception()  # nothing was sent yet: an HTTP error
        return await _respond(request, first, deltas, formatter, (timeout, deadline),
                              idle_timeout)
    finally:
        first.cancel()  # the client left while it waited


async def _respond(request: web.Request, first: asyncio.Future, deltas: AsyncIterator,
                   formatter: responses.Formatter, limit: tuple[float | None, float | None],
                   idle_timeout: float | None) -> tuple[web.StreamResponse, str]:
    """`limit`: the request timeout and the loop time it ends at."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    small_send_buffer(request)
    await response.prepare(request)

    async def write(data: bytes) -> None:
        try:
            async with asyncio.timeout(idle_timeout):
                await response.write(data)
        except TimeoutError:
            raise ClientStalledError from None

    try:
        status = await _events(request, write, first, deltas, formatter, limit)
        await write(b"data: [DONE]\n\n")
        async with asyncio.timeout(idle_timeout):
            await response.write_eof()
    except ConnectionResetError:
        status = "disconnected"
        request[CLIENT_LEFT] = True
    except (ClientStalledError, TimeoutError):
        status = "idle"
        request[CLIENT_LEFT] = True
        if request.transport is not None:  # close() would wait for the buffer to drain
            request.transport.abort()
    return response, status


async def _events(request: web.Request, write: Callable[[bytes], Awaitable[None]],
                  first: asyncio.Future, deltas: AsyncIterator,
                  formatter: responses.Formatter,
                  limit: tuple[float | None, float | None]) -> str:
    timeout, deadline = limit
    status = "error"
    try:
        for chunk in formatter.stream_start():
            await write(responses.sse(chunk))
        async with asyncio.timeout_at(deadline):
            delta = await first
            while delta is not None:
                for chunk in formatter.stream_chunks(delta):
                    await write(responses.sse(chunk))
                delta = await anext(deltas, None)
        usage = formatter.stream_usage()
        if usage is not None:
            await write(responses.sse(usage))
        status = "ok"
    except (ConnectionResetError, ClientStalledError):
        raise
    except TimeoutError:
        status = "timeout"
        await write(responses.sse(timed_out(timeout).body()))
    except (EngineDeadError, OpenAIError) as e:
        err = e if isinstance(e, OpenAIError) else OpenAIError(500, str(e), "engine_error")
        await write(responses.sse(err.body()))
    except Exception:  # the headers are out: a bug ends this stream with an event
        await write(responses.sse(internal_error(request).body()))
    return status

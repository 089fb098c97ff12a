"""A streamed generation as server-sent events, and how the stream ended: the headers go out
first, so every end after them (done, timed out, engine dead, a bug) is an event, then
`[DONE]`; a client that left gets nothing more."""

from __future__ import annotations

import asyncio

from aiohttp import web

from parashift.serve import responses
from parashift.serve.engine_errors import EngineDeadError
from parashift.serve.generation import Generation
from parashift.serve.http_guards import internal_error, request_key
from parashift.serve.openai_protocol import OpenAIError

CLIENT_LEFT = request_key("parashift.client_left", bool)  # the client went away mid-stream


def timed_out(timeout: float | None) -> OpenAIError:
    return OpenAIError(504, f"the request took longer than --request-timeout ({timeout:g} s) "
                       "and was aborted", "timeout")


async def stream(request: web.Request, gen: Generation, formatter: responses.Formatter,
                 timeout: float | None) -> tuple[web.StreamResponse, str]:
    """The SSE response and how it ended: ok, timeout or error (an event says which), or
    disconnected (the client left; `request[CLIENT_LEFT]` is set)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        status = await _events(request, response, gen, formatter, timeout)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        status = "disconnected"
        request[CLIENT_LEFT] = True
    return response, status


async def _events(request: web.Request, response: web.StreamResponse, gen: Generation,
                  formatter: responses.Formatter, timeout: float | None) -> str:
    status = "error"
    try:
        for chunk in formatter.stream_start():
            await response.write(responses.sse(chunk))
        async with asyncio.timeout(timeout):
            async for delta in gen.stream():
                for chunk in formatter.stream_chunks(delta):
                    await response.write(responses.sse(chunk))
        usage = formatter.stream_usage()
        if usage is not None:
            await response.write(responses.sse(usage))
        status = "ok"
    except ConnectionResetError:
        raise
    except TimeoutError:
        status = "timeout"
        await response.write(responses.sse(timed_out(timeout).body()))
    except (EngineDeadError, OpenAIError) as e:
        err = e if isinstance(e, OpenAIError) else OpenAIError(500, str(e), "engine_error")
        await response.write(responses.sse(err.body()))
    except Exception:  # the headers are out: a bug ends this stream with an event
        await response.write(responses.sse(internal_error(request).body()))
    return status

"""How an API server answers a generation, and how the answer ended: a stream as server-sent
events (serve/sse.py), or a whole body once the generation is done (within
--non-stream-timeout, or --request-timeout when shorter: a 504), built off the event loop and
written by us, not by aiohttp after the handler returns: each write is paced
(serve/pacing.py) and a client that reads nothing is dropped like a stream's ("idle"),
instead of pinning the body for ever. Each request's end is counted in the metrics."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import msgspec
from aiohttp import web

from parashift.serve import responses, sse
from parashift.serve.generation import Generation
from parashift.serve.limits import ServeLimits
from parashift.serve.metrics import Metrics
from parashift.serve.pacing import SEND_BUFFER, Pace, small_send_buffer


@dataclass(frozen=True)
class Responder:
    request_timeout: float | None  # --request-timeout: streams and whole bodies
    limits: ServeLimits
    executor: Executor  # where bodies are built (the tokenizer's thread: logprob texts)
    metrics: Metrics

    async def respond(self, request: web.Request, gen: Generation,
                      formatter: responses.Formatter) -> web.StreamResponse:
        idle_timeout = self.limits.stream_idle_timeout
        limit, flag = sse.non_stream_limit(self.request_timeout, self.limits.non_stream_timeout)
        status = "error"
        try:
            if gen.streamed:
                response, status = await sse.stream(request, gen, formatter,
                                                    self.request_timeout, idle_timeout)
                return response
            async with asyncio.timeout(limit):
                async for _ in gen.stream():
                    pass
            body = await self._build(formatter)
            response, status = await write_whole(request, body, idle_timeout)
            return response
        except TimeoutError:
            status = "timeout"
            raise sse.timed_out(limit, flag) from None
        except asyncio.CancelledError:
            status = "disconnected"
            raise
        finally:
            gen.abort_unfinished()  # a timeout or a disconnect leaves no sample running
            t = gen.timing
            self.metrics.observe_request(status, gen.num_prompt_tokens, gen.num_output_tokens,
                                         t.arrival, t.first_token, time.monotonic())

    async def _build(self, formatter: responses.Formatter) -> bytes:
        """The whole body, built and encoded in the tokenizer's thread (its logprob texts are
        decoded there), never on the event loop; a finished generation is never refused, so
        it skips the pool's queue bound."""
        def build() -> bytes:
            return msgspec.json.encode(formatter.full_response())

        return await asyncio.get_running_loop().run_in_executor(self.executor, build)


def paced_answers(idle_timeout: float):
    """A middleware, outermost: every answer not yet written (any route's, an error's), which
    aiohttp would write after the handler with no time limit, written here within
    `idle_timeout`; a client that pipelines requests and reads none of the answers is dropped
    instead of holding its connection. Streams and whole bodies write their own."""

    @web.middleware
    async def paced(request: web.Request, handler) -> web.StreamResponse:
        response = await handler(request)
        if not response.prepared:
            try:
                async with asyncio.timeout(idle_timeout):
                    await response.prepare(request)
                    await response.write_eof()
            except ConnectionResetError:
                pass  # aiohttp's own write_eof after this sees it, and ends the connection
            except TimeoutError:
                if request.transport is not None:
                    request.transport.abort()
        return response

    return paced


async def write_whole(request: web.Request, body: bytes,
                      idle_timeout: float) -> tuple[web.StreamResponse, str]:
    """A JSON body written in pieces of the send buffer's size, each paced; "ok",
    "disconnected", or "idle" when the client read too little (dropped: its transport
    aborted, since close() would wait for the buffer to drain). The last two set
    request[CLIENT_LEFT] (a 499 in the metrics)."""
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = len(body)
    small_send_buffer(request)
    pace, view = Pace(idle_timeout), memoryview(body)
    try:
        async with asyncio.timeout(pace.timeout()):
            await response.prepare(request)
        for start in range(0, len(body), SEND_BUFFER):
            async with asyncio.timeout(pace.timeout()):
                await response.write(view[start:start + SEND_BUFFER])
            pace.moved(min(SEND_BUFFER, len(body) - start))
        async with asyncio.timeout(pace.timeout()):
            await response.write_eof()
    except ConnectionResetError:
        request[sse.CLIENT_LEFT] = True
        return response, "disconnected"
    except TimeoutError:
        request[sse.CLIENT_LEFT] = True
        if request.transport is not None:
            request.transport.abort()
        return response, "idle"
    return response, "ok"

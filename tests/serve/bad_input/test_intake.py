"""Bodies that do not arrive as they should, against serve/intake.py's read_body on a small
aiohttp server of its own (no engines): past --max-body-size a 413, declared or as it comes; a
body that stops arriving a 408, and the connection closed; and the pace a body must keep
(serve/pacing.py), on a clock of the test's."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from parashift.serve import pacing
from parashift.serve.http_guards import errors_to_openai
from parashift.serve.intake import read_body
from parashift.serve.openai_protocol import CompletionRequest

IDLE_S = 0.5
MAX_BODY = 1024
HEAD = b"POST / HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"


async def serving() -> tuple[web.AppRunner, int]:
    async def handler(request: web.Request) -> web.Response:
        req = await read_body(request, CompletionRequest, IDLE_S)
        return web.json_response({"prompt": req.prompt})

    app = web.Application(middlewares=[errors_to_openai], client_max_size=MAX_BODY)
    app.router.add_post("/", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    lines = head.decode().split("\r\n")
    length = next(int(line.split(":")[1]) for line in lines
                  if line.lower().startswith("content-length:"))
    body = await asyncio.wait_for(reader.readexactly(length), 30)
    return int(lines[0].split()[1]), json.loads(body)


async def exchange(port: int, data: bytes) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        result = await answer(reader)
        writer.write_eof()  # the server's handling ends with the body (no lingering read)
        await asyncio.wait_for(reader.read(), 30)
        return result
    finally:
        writer.close()


def test_a_body_read_whole_is_decoded():
    async def main() -> None:
        runner, port = await serving()
        body = b'{"prompt": "hi"}'
        chunked = b"4\r\n" + body[:4] + b"\r\n" + b"%x\r\n" % (len(body) - 4) + body[4:] + \
            b"\r\n0\r\n\r\n"
        for request in (HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body,
                        HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked):
            assert await exchange(port, request) == (200, {"prompt": "hi"})
        await runner.cleanup()

    asyncio.run(main())


def test_past_max_body_size_is_a_413_declared_or_as_it_comes():
    async def main() -> None:
        runner, port = await serving()
        # Declared too long: refused before any of it is sent.
        status, _ = await exchange(port, HEAD + b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1))
        assert status == 413
        oversized = b"x" * (MAX_BODY + 1)
        status, _ = await exchange(port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
                                   + b"%x\r\n" % len(oversized) + oversized + b"\r\n")
        assert status == 413
        await runner.cleanup()

    asyncio.run(main())


def test_a_body_that_stops_arriving_is_a_408_and_the_connection_closes():
    async def main() -> None:
        runner, port = await serving()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD + b'Content-Length: 40\r\n\r\n{"prompt": ')  # then nothing
        status, body = await answer(reader)
        assert status == 408 and "--stream-idle-timeout" in body["error"]["message"]
        writer.write_eof()  # ends aiohttp's lingering read of the rest at once
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed, not kept alive
        writer.close()
        await runner.cleanup()

    asyncio.run(main())


def test_a_body_must_keep_the_minimum_rate_past_the_idle_bound():
    now = [100.0]
    pace = pacing.Pace(idle_timeout=60.0, clock=lambda: now[0])
    assert pace.timeout() == 60.0
    now[0] += 50.0
    assert pace.timeout() == pytest.approx(10.0)  # the idle bound, from the start
    pace.moved(pacing.MIN_RATE * 100)  # 100 s more to spend
    assert pace.timeout() == 60.0  # no single wait past the idle bound
    now[0] += 105.0
    assert pace.timeout() == pytest.approx(5.0)
    now[0] += 10.0
    assert pace.timeout() == 0.0  # a trickle spent its bytes' worth

"""A bug inside a handler fails its request with a 500 whose body names the request's id, never
the exception's text (which may hold another request's content); the log has the traceback
under that id. A stream whose headers are out ends with the same error as an event."""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from parashift.serve import sse
from parashift.serve.http_guards import REQUEST_ID, errors_to_openai


def _post(handler) -> tuple[int, str]:
    """A POST to `handler` served behind the error middleware, over a real socket."""
    async def call() -> tuple[int, str]:
        app = web.Application(middlewares=[errors_to_openai])
        app.router.add_post("/v1/completions", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/completions", json={})
            return resp.status, await resp.text()

    return asyncio.run(call())


def test_a_500_body_holds_no_exception_text(caplog):
    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("secret prompt text")

    with caplog.at_level(logging.ERROR):
        status, text = _post(broken)
    body = json.loads(text)
    assert status == 500 and body["error"]["type"] == "internal_error"
    assert "secret" not in json.dumps(body)
    request_id = body["error"]["message"].split()[4]
    assert request_id.startswith("http-")
    assert any(request_id in r.getMessage() and r.exc_info for r in caplog.records)


class _BrokenFormatter:
    """A formatter with a bug: what a stream writes after its headers meets it."""

    def stream_start(self):
        raise RuntimeError("secret prompt text")


class _Finished:
    """A generation with nothing more to stream (its first delta, awaited before the headers,
    is the end)."""

    async def stream(self):
        return
        yield


def test_a_streamed_500_holds_no_exception_text(caplog):
    async def streaming(request: web.Request) -> web.StreamResponse:
        request[REQUEST_ID] = "cmpl-0-test"
        response, status = await sse.stream(request, _Finished(), _BrokenFormatter(), None)
        assert status == "error"
        return response

    with caplog.at_level(logging.ERROR):
        status, text = _post(streaming)
    events = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    assert status == 200 and text.endswith("data: [DONE]\n\n")  # the headers were out
    assert [e["error"]["type"] for e in events] == ["internal_error"]
    assert "secret" not in text and "cmpl-0-test" in events[0]["error"]["message"]
    assert any("cmpl-0-test" in r.getMessage() and r.exc_info for r in caplog.records)

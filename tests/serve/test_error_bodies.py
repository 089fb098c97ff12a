"""A bug inside a handler fails its request with a 500 whose body names the log entry, never
the exception's text (which may hold another request's content); the log has the traceback."""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from parashift.serve.http_guards import errors_to_openai


def test_a_500_body_holds_no_exception_text(caplog):
    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("secret prompt text")

    async def call() -> tuple[int, dict]:
        app = web.Application(middlewares=[errors_to_openai])
        app.router.add_post("/v1/completions", broken)
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/completions", json={})
            return resp.status, await resp.json()

    with caplog.at_level(logging.ERROR):
        status, body = asyncio.run(call())
    assert status == 500 and body["error"]["type"] == "internal_error"
    assert "secret" not in json.dumps(body)
    error_id = body["error"]["message"].rsplit(" ", 1)[-1].rstrip(")")
    assert any(error_id in r.getMessage() and r.exc_info for r in caplog.records)

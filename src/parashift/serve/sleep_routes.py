"""POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping: each call reaches every live engine
(all dp ranks together). /sleep answers once every engine has drained and slept; the memory
each released is in the answer and in /metrics. While asleep, requests get a 503 (or wait,
with --while-asleep wait)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from parashift.serve.broker import Broker
from parashift.serve.metrics import Metrics
from parashift.serve.openai_protocol import OpenAIError


def _json(data: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), content_type="application/json")


class SleepRoutes:
    def __init__(self, broker: Broker, metrics: Metrics):
        self.broker, self.metrics = broker, metrics

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)

    async def _call_all(self, method: str, arg: int = 0) -> dict[int, Any]:
        ranks = self.broker.alive_engines()
        if not ranks:
            raise OpenAIError(503, "no engine is up", "service_unavailable_error")
        try:
            results = await asyncio.gather(*(self.broker.utility(method, r, arg) for r in ranks))
        except RuntimeError as e:  # an engine refused the call
            raise OpenAIError(400, str(e)) from None
        for rank, result in zip(ranks, results, strict=True):
            self.metrics.sleep_level.labels(f"dp{rank}").set(result["level"])
            if "released_bytes" in result:
                self.metrics.sleep_released.labels(f"dp{rank}").set(result["released_bytes"])
        return dict(zip(ranks, results, strict=True))

    async def sleep(self, request: web.Request) -> web.Response:
        level = request.query.get("level", "1")
        if level not in ("1", "2"):
            raise OpenAIError(400, f"level={level!r}: use 1 (free the KV cache) or 2 (the "
                              "weights too)", param="level")
        results = await self._call_all("sleep", int(level))
        return _json({"sleeping": True, "level": int(level),
                      "engines": {f"dp{r}": v for r, v in results.items()}})

    async def wake_up(self, request: web.Request) -> web.Response:
        results = await self._call_all("wake_up")
        return _json({"sleeping": False, "engines": {f"dp{r}": v for r, v in results.items()}})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        results = await self._call_all("is_sleeping")
        levels = {f"dp{r}": v["level"] for r, v in results.items()}
        return _json({"is_sleeping": all(levels.values()), "levels": levels})

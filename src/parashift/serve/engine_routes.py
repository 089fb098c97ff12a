"""The routes that act on every live engine at once (all dp ranks together):
POST /reset_prefix_cache, and POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping. /sleep
answers once every engine has drained and slept; the memory each released is in the answer
and in /metrics. While asleep, requests get a 503 (or wait, with --while-asleep wait).
POST /scale {"data_parallel_size": N} (and vLLM's POST /scale_elastic_ep
{"new_data_parallel_size": N}) asks the launcher for N ranks and answers when N serve
(runtime/scale.py).

They are admin routes: added only with an admin key (--admin-api-key, PARASHIFT_ADMIN_KEY),
which they then take instead of the API key (serve/http_guards.py require_key), or with
--enable-admin-routes (behind the API key, if any: a trusted network only)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from parashift.serve.engine_client import EngineClient
from parashift.serve.engine_errors import EngineDeadError, EngineUnavailableError
from parashift.serve.metrics import Metrics
from parashift.serve.openai_protocol import OpenAIError
from parashift.wire.engine_calls import EngineCall, IsSleeping, ResetPrefixCache, Sleep, WakeUp

ADMIN_ROUTES = frozenset(("/reset_prefix_cache", "/sleep", "/wake_up", "/is_sleeping",
                          "/scale", "/scale_elastic_ep"))
SCALE_FIELDS = {"/scale": "data_parallel_size", "/scale_elastic_ep": "new_data_parallel_size"}


def _json(data: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), content_type="application/json")


class EngineRoutes:
    def __init__(self, engines: EngineClient, metrics: Metrics):
        self.engines, self.metrics = engines, metrics

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        for path in SCALE_FIELDS:
            app.router.add_post(path, self.scale)

    async def _call_all(self, kind: type[EngineCall], *args: Any) -> dict[int, Any]:
        """Every live engine's answer, by rank. A rank that died or cannot be reached makes
        it a 503 naming it; an engine's refusal a 400."""
        ranks = self.engines.alive_engines()
        if not ranks:
            raise OpenAIError(503, "no engine is up", "service_unavailable_error")
        results = await asyncio.gather(*(self.engines.call(r, kind, *args) for r in ranks),
                                       return_exceptions=True)
        answers = dict(zip(ranks, results, strict=True))
        for rank, result in answers.items():
            if isinstance(result, EngineDeadError | EngineUnavailableError):
                raise OpenAIError(503, f"engine dp{rank}: {result}", "service_unavailable_error")
            if isinstance(result, RuntimeError):  # the engine's own words (a bad level)
                raise OpenAIError(400, f"engine dp{rank}: {result}")
            if isinstance(result, BaseException):  # a bug here: a 500 naming no text
                raise result
        for rank, result in answers.items():
            # At once in this API server; the others hear it through the coordinator.
            self.metrics.sleep_level.labels(f"dp{rank}").set(result["level"])
            self.metrics.sleep_released.labels(f"dp{rank}").set(result["released_bytes"])
            if kind is not IsSleeping:  # the rank's prefix cache is empty now
                self.engines.router.forget(rank)
        return answers

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        results = {}
        for rank in self.engines.alive_engines():
            results[f"dp{rank}"] = await self.engines.call(rank, ResetPrefixCache)
            if results[f"dp{rank}"]:
                self.engines.router.forget(rank)  # at once here; the others via the coordinator
        return _json({"reset": results})

    async def sleep(self, request: web.Request) -> web.Response:
        level = request.query.get("level", "1")
        if level not in ("1", "2"):
            raise OpenAIError(400, f"level={level!r}: use 1 (free the KV cache) or 2 (the "
                              "weights too)", param="level")
        results = await self._call_all(Sleep, int(level))
        # each rank's own level: a /wake_up during the drain leaves a rank awake
        return _json({"sleeping": all(v["level"] for v in results.values()),
                      "level": int(level),
                      "engines": {f"dp{r}": v for r, v in results.items()}})

    async def wake_up(self, request: web.Request) -> web.Response:
        results = await self._call_all(WakeUp)
        return _json({"sleeping": False, "engines": {f"dp{r}": v for r, v in results.items()}})

    async def is_sleeping(self, request: web.Request) -> web.Response:
        results = await self._call_all(IsSleeping)
        levels = {f"dp{r}": v["level"] for r, v in results.items()}
        return _json({"is_sleeping": all(levels.values()), "levels": levels})

    async def scale(self, request: web.Request) -> web.Response:
        field = SCALE_FIELDS[request.path]
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as e:
            raise OpenAIError(400, f"the body is not JSON ({e})") from None
        size = body.get(field) if isinstance(body, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise OpenAIError(400, f"give {{\"{field}\": N}} with a whole number N >= 1",
                              param=field)
        # Asked of the engines themselves: the coordinator's vector may not carry a sleep
        # that has just been answered.
        levels = await self._call_all(IsSleeping)
        asleep = [r for r, answer in levels.items() if answer["level"]]
        if asleep:
            raise OpenAIError(409, f"engine(s) {', '.join(f'dp{r}' for r in asleep)} are "
                              "asleep: wake them (POST /wake_up) before scaling",
                              "conflict_error")
        result = await self.engines.scale(size)
        self.metrics.scale_events.labels(
            "ok" if not result.error else "refused" if result.status < 500 else "failed").inc()
        if result.error:
            raise OpenAIError(result.status, result.error, {
                409: "conflict_error", 503: "service_unavailable_error"}.get(
                    result.status, "invalid_request_error"))
        return _json({"data_parallel_size": result.size})

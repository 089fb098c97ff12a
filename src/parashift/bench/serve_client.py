"""`parashift bench serve`: a streaming load generator for any OpenAI-compatible
/v1/completions server. Arrivals follow a gamma process (Poisson at burstiness 1) at the
requested rate, or all at once at rate inf; --max-concurrency caps requests in flight. A request
may follow another (a conversation's next turn): it is sent once that one has finished."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable

import aiohttp
import numpy as np

from parashift.bench.datasets import BenchRequest
from parashift.bench.metrics import RequestRecord


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Offsets in seconds from the start. Gaps ~ Gamma(shape=burstiness, mean=1/rate):
    burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


async def run_load(base_url: str, model: str | None, requests: list[BenchRequest],
                   rate: float, burstiness: float = 1.0, max_concurrency: int | None = None,
                   seed: int = 0, api_key: str | None = None,
                   on_done: Callable[[RequestRecord], None] | None = None,
                   sampling: dict | None = None, follows: list[int | None] | None = None
                   ) -> tuple[list[RequestRecord], float]:
    """Sends every request (greedy, or with `sampling`'s fields); returns their records and
    the run's duration in seconds. `follows[i]`, where not None, is the request that request i
    waits for: i is sent when that one has finished, and the arrivals pace only the requests
    that follow none."""
    url = base_url.rstrip("/")
    url = url + ("/completions" if url.endswith("/v1") else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if model is None:
        model = await _first_model(url.rsplit("/completions", 1)[0], headers)
    follows = follows or [None] * len(requests)
    heads = [i for i, f in enumerate(follows) if f is None]
    offsets = [0.0] * len(requests)
    for i, offset in zip(heads, arrival_times(len(heads), rate, burstiness, seed), strict=True):
        offsets[i] = offset
    finished = [asyncio.Event() for _ in requests]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(r.prompt_len, r.output_len) for r in requests]
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                     headers=headers) as session:
        start = time.perf_counter()

        async def one(i: int) -> None:
            if follows[i] is not None:
                await finished[follows[i]].wait()
            await asyncio.sleep(max(0.0, offsets[i] - (time.perf_counter() - start)))
            try:
                if limit is None:
                    await _stream(session, url, model, requests[i], records[i], start, sampling)
                else:
                    async with limit:
                        await _stream(session, url, model, requests[i], records[i], start,
                                      sampling)
            finally:
                finished[i].set()
            if on_done is not None:
                on_done(records[i])

        await asyncio.gather(*(one(i) for i in range(len(requests))))
        return records, time.perf_counter() - start


async def _first_model(v1_url: str, headers: dict[str, str]) -> str:
    async with aiohttp.ClientSession(headers=headers) as session, \
            session.get(v1_url + "/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def _stream(session: aiohttp.ClientSession, url: str, model: str, request: BenchRequest,
                  record: RequestRecord, run_start: float, sampling: dict | None) -> None:
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.output_len,
            **(sampling or {"temperature": 0.0}), "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    record.start = sent - run_start
    last, chunks, usage = None, 0, None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {_error_message(await resp.text())}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = f"stream error: {_error_message(json.dumps(event))}"
                    return
                if event.get("usage"):
                    usage = event["usage"].get("completion_tokens")
                if not any(c.get("text") for c in event.get("choices") or []):
                    continue
                now = time.perf_counter()
                if last is None:
                    record.ttft = now - sent
                else:
                    record.itl.append(now - last)
                last = now
                chunks += 1
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"[:200]
        return
    record.e2e = time.perf_counter() - sent
    record.generated = usage if usage is not None else chunks


def _error_message(text: str) -> str:
    try:
        error = json.loads(text).get("error", {})
        return str(error.get("message", error) if isinstance(error, dict) else error)[:200]
    except (ValueError, AttributeError):
        return text[:200]

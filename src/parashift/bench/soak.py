"""`parashift bench soak`: a long mixed run against a real server, with faults and hostile
input, and the checks that nothing was lost on the way.

The server is `dp2` behind two API servers (`--restart-dead-engines`). The requests mix
lengths, streaming and not, completions and chat. 10% are bad (each must get its 4xx), 10%
are streams whose client leaves after the first event, 2% carry n>1, logprobs or stop
strings. Part-way through, engine dp1 is SIGKILLed; it restarts, and the requests it held
fail over. Afterwards:
- every good request succeeded with the right number of tokens and usage, except streams
  that had already sent tokens when the engine died (they get the error event: counted);
- every rank's KV cache is empty again;
- the server's resident memory grew less than 10% after warm-up;
- the server counted exactly the answers the client saw, by status, and no response id
  came twice."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from parashift.bench.server import process_title, process_tree

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SERVER_ARGS = ["--strategy", "dp2", "--api-server-count", "2", "--restart-dead-engines",
               "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--dtype", "float32"]
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "light", "north", "seven")
BAD = [  # (body, the status it must get)
    (b'{"prompt": "hi", "max_tokens": ', 400),
    (json.dumps({"prompt": "hi", "n": 100000}).encode(), 400),
    (json.dumps({"prompt": "hi", "seed": 2**80}).encode(), 400),
    (json.dumps({"prompt": "hi", "max_token": 4}).encode(), 400),
    (json.dumps({"prompt": "hi", "max_tokens": -3}).encode(), 400),
    (json.dumps({"prompt": [1] * 600, "max_tokens": 4}).encode(), 400),  # past max-model-len
    (json.dumps({"prompt": "hi", "model": "no-such-model"}).encode(), 404),
    (json.dumps({"prompt": [1, 2**40]}).encode(), 400),
]
MAX_RSS_GROWTH = 0.10


@dataclass
class SoakRequest:
    kind: str  # good, special, bad, disconnect
    path: str
    body: bytes
    stream: bool = False
    tokens: int | None = None  # completion tokens a good request must report
    status: int = 200  # what a bad one must get
    logprobs: bool = False


@dataclass
class Outcome:
    kind: str
    status: int  # the HTTP status; 499: we left
    ok: bool
    why: str = ""
    response_id: str | None = None
    start: float = 0.0
    end: float = 0.0
    cut_by_kill: bool = False  # a stream the engine's death ended after it had sent tokens


@dataclass
class SoakReport:
    outcomes: list[Outcome]
    seconds: float
    kill_at: float | None = None  # seconds from the start
    back_after_s: float | None = None  # the killed rank healthy again
    settled_after_s: float | None = None  # every request in flight at the kill finished
    rss_mib: list[tuple[int, float]] = field(default_factory=list)  # (done, server tree)
    rss_by_process: list[dict[str, float]] = field(default_factory=list)  # warm-up, end
    kv_usage_after: dict[str, float] = field(default_factory=dict)
    server_codes: dict[str, int] = field(default_factory=dict)
    failovers: dict[str, float] = field(default_factory=dict)

    def counts(self) -> dict[str, Counter]:
        out: dict[str, Counter] = {}
        for o in self.outcomes:
            label = "ok" if o.ok else ("cut by the kill" if o.cut_by_kill else "FAILED")
            out.setdefault(o.kind, Counter())[label] += 1
        return out

    def rss_growth(self) -> float:
        warm = self.rss_mib[len(self.rss_mib) // 10][1] if self.rss_mib else 0.0
        return self.rss_mib[-1][1] / warm - 1 if warm else 0.0

    def failures(self) -> list[str]:
        """What broke the soak's promises; empty when it held."""
        bad = [f"{o.kind} request answered {o.status}: {o.why}" for o in self.outcomes
               if not o.ok and not o.cut_by_kill]
        client = Counter(str(o.status) for o in self.outcomes)
        if dict(client) != self.server_codes:
            bad.append(f"the client saw {dict(client)}, the server counted {self.server_codes}")
        ids = [o.response_id for o in self.outcomes if o.response_id]
        if len(ids) != len(set(ids)):
            bad.append(f"{len(ids) - len(set(ids))} response ids came twice")
        leaked = {rank: v for rank, v in self.kv_usage_after.items() if v != 0}
        if leaked or not self.kv_usage_after:
            bad.append(f"KV cache not empty after the run: {self.kv_usage_after}")
        if self.rss_growth() >= MAX_RSS_GROWTH:
            bad.append(f"the server's memory grew {self.rss_growth():.1%} after warm-up")
        return bad


def plan(num_requests: int, vocab: int, seed: int = 0) -> list[SoakRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        draw = rng.random()
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(4, 96))]
        tokens = rng.randint(1, 32)
        if draw < 0.10:
            body, status = rng.choice(BAD)
            out.append(SoakRequest("bad", COMPLETIONS, body, status=status))
        elif draw < 0.20:
            out.append(SoakRequest("disconnect", COMPLETIONS, _body(
                {"prompt": ids, "max_tokens": 200, "ignore_eos": True, "stream": True}), True))
        elif draw < 0.22:
            out.append(_special(rng, ids, tokens))
        else:
            stream = rng.random() < 0.5
            sampling = ({"temperature": 0} if rng.random() < 0.5
                        else {"temperature": 0.8, "seed": rng.randrange(1000)})
            extra = {"stream": stream, "ignore_eos": True, "max_tokens": tokens, **sampling,
                     **({"stream_options": {"include_usage": True}} if stream else {})}
            if rng.random() < 0.3:
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
                body = {"messages": [{"role": "user", "content": text}], **extra}
                out.append(SoakRequest("good", CHAT, _body(body), stream, tokens))
            else:
                out.append(SoakRequest("good", COMPLETIONS, _body({"prompt": ids, **extra}),
                                       stream, tokens))
    return out


def _special(rng: random.Random, ids: list[int], tokens: int) -> SoakRequest:
    base = {"prompt": ids, "max_tokens": tokens, "ignore_eos": True}
    which = rng.choice(["n", "logprobs", "stop"])
    if which == "n":
        return SoakRequest("special", COMPLETIONS, _body({**base, "n": 2, "seed": 1}),
                           tokens=2 * tokens)
    if which == "logprobs":
        return SoakRequest("special", COMPLETIONS, _body({**base, "logprobs": 2}),
                           tokens=tokens, logprobs=True)
    return SoakRequest("special", COMPLETIONS, _body({**base, "stop": ["e", "a"],
                                                      "ignore_eos": False}))


def _body(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode()


async def _send(session: aiohttp.ClientSession, url: str, req: SoakRequest, start: float
                ) -> Outcome:
    o = Outcome(req.kind, 0, False, start=time.monotonic() - start)
    try:
        async with session.post(url + req.path, data=req.body, headers={
                "Content-Type": "application/json"}) as r:
            o.status = r.status
            if req.kind == "bad":
                body = await r.json(content_type=None)
                o.ok = r.status == req.status and set(body) == {"error"}
                o.why = "" if o.ok else f"wanted {req.status}: {body}"
            elif req.kind == "disconnect":
                async for _ in r.content:  # the first line of the stream, then we leave
                    break
                o.status, o.ok = 499, True
                r.close()
            elif req.stream and r.status == 200:
                _check_stream(o, req, [line async for line in r.content])
            else:
                _check_json(o, req, await r.json(content_type=None))
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        o.why = f"{type(e).__name__}: {e}"
    o.end = time.monotonic() - start
    return o


def _check_json(o: Outcome, req: SoakRequest, body: dict) -> None:
    if o.status != 200:
        o.why = str(body)
        return
    o.response_id = body.get("id")
    got = body["usage"]["completion_tokens"]
    if req.tokens is not None and got != req.tokens:
        o.why = f"{got} completion tokens, wanted {req.tokens}"
        return
    if req.logprobs and any(len(c["logprobs"]["tokens"]) != req.tokens
                            for c in body["choices"]):
        o.why = "logprobs do not cover every token"
        return
    o.ok = all(c["finish_reason"] in ("length", "stop") for c in body["choices"])
    o.why = "" if o.ok else f"finish reasons {[c['finish_reason'] for c in body['choices']]}"


def _check_stream(o: Outcome, req: SoakRequest, lines: list[bytes]) -> None:
    events = [line[6:].strip() for line in lines if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        o.why = "the stream did not end with [DONE]"
        return
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    if errors:
        had_tokens = any(c.get("choices") and (c["choices"][0].get("text") or
                                               c["choices"][0].get("delta", {}).get("content"))
                         for c in chunks)
        o.cut_by_kill = had_tokens and "died" in errors[0]["message"]
        o.why = errors[0]["message"]
        return
    usage = [c["usage"] for c in chunks if c.get("usage")]
    o.response_id = chunks[0].get("id") if chunks else None
    o.ok = bool(usage) and usage[-1]["completion_tokens"] == req.tokens
    o.why = "" if o.ok else f"usage {usage[-1:] or 'missing'}, wanted {req.tokens} tokens"


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (Linux /proc)."""
    return sum(tree_rss_by_process(pid).values())


def tree_rss_by_process(pid: int) -> dict[str, float]:
    """MiB resident per process (by its title) of a process and all its descendants."""
    out = {}
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (OSError, ValueError, IndexError):
            continue
        name = process_title(p) or str(p)
        out[f"{name} ({p})" if name in out else name] = rss
    return out


def engine_pid(server_pid: int, rank: int) -> int:
    """The pid of engine dp<rank> under the server (by its process title)."""
    for pid in process_tree(server_pid):
        if process_title(pid) == f"parashift-engine-dp{rank}":
            return pid
    raise RuntimeError(f"no parashift-engine-dp{rank} under pid {server_pid}")


def scrape_every_api_server(url: str, num_servers: int, tries: int = 200) -> list[str]:
    """GET /metrics until every API server has answered once (new connections spread over
    them); one exposition text each."""
    seen: dict[str, str] = {}
    for _ in range(tries):
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        m = re.search(r'^parashift_api_server\{index="(\d+)"\} 1', text, re.MULTILINE)
        if m:
            seen[m.group(1)] = text
        if len(seen) == num_servers:
            return list(seen.values())
    raise RuntimeError(f"only API servers {sorted(seen)} of {num_servers} answered /metrics")


def _samples(text: str, name: str) -> dict[str, float]:
    return {label: float(v) for label, v in re.findall(
        rf'^{name}\{{\w+="([^"]+)"\}} (\S+)$', text, re.MULTILINE)}


async def run_soak(url: str, server_pid: int, requests: list[SoakRequest], concurrency: int,
                   kill_at: int | None, num_api_servers: int = 2, progress=None
                   ) -> SoakReport:
    """Sends `requests` with `concurrency` in flight; SIGKILLs engine dp1 when request
    `kill_at` is sent (None: no fault)."""
    outcomes: list[Outcome | None] = [None] * len(requests)
    report = SoakReport([], 0.0)
    next_index, done = 0, 0
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300)
    start = time.monotonic()
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(
            limit=0, force_close=True)) as session:  # new connections reach both servers

        watch: list[asyncio.Task] = []
        warm_rss: dict[str, float] = {}

        async def watch_back() -> None:  # the killed rank, restarted, healthy again
            await asyncio.sleep(0.5)  # the death is noticed first
            while True:
                try:
                    async with session.get(url + "/health") as r:
                        if r.status == 200:
                            report.back_after_s = time.monotonic() - start - report.kill_at
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)

        async def worker() -> None:
            nonlocal next_index, done
            while next_index < len(requests):
                i, next_index = next_index, next_index + 1
                if i == kill_at:
                    os.kill(engine_pid(server_pid, 1), signal.SIGKILL)
                    report.kill_at = time.monotonic() - start
                    watch.append(asyncio.create_task(watch_back()))
                outcomes[i] = await _send(session, url, requests[i], start)
                done += 1
                if done == len(requests) // 10:
                    warm_rss.update(tree_rss_by_process(server_pid))
                if done % max(1, len(requests) // 50) == 0:
                    report.rss_mib.append((done, await loop.run_in_executor(
                        None, tree_rss_mib, server_pid)))
                if progress is not None:
                    progress()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if watch:
            await asyncio.wait_for(watch[0], 120)
    report.seconds = time.monotonic() - start
    report.outcomes = [o for o in outcomes if o is not None]
    report.rss_mib.append((done, tree_rss_mib(server_pid)))
    report.rss_by_process = [warm_rss, tree_rss_by_process(server_pid)]
    if report.kill_at is not None:
        in_flight = [o.end for o in report.outcomes if o.start <= report.kill_at < o.end]
        report.settled_after_s = max(in_flight) - report.kill_at if in_flight else 0.0
    await loop.run_in_executor(None, _after, url, num_api_servers, report)
    return report


def _after(url: str, num_api_servers: int, report: SoakReport) -> None:
    """Waits for the killed rank to be back and the KV caches to drain, then reads what
    every API server counted."""
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=30) as r:
                healthy = r.status == 200
        except OSError:
            healthy = False
        texts = scrape_every_api_server(url, num_api_servers)
        kv = _samples(texts[0], "parashift_kv_cache_usage_ratio")
        if healthy and kv and all(v == 0 for v in kv.values()):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    report.kv_usage_after = kv
    time.sleep(0.5)  # a cancelled handler counts its 499 as it unwinds
    codes: Counter = Counter()
    failovers: Counter = Counter()
    for text in scrape_every_api_server(url, num_api_servers):
        codes.update(_samples(text, "parashift_http_responses_total"))
        failovers.update(_samples(text, "parashift_request_failovers_total"))
    report.server_codes = {code: int(n) for code, n in codes.items()}
    report.failovers = dict(failovers)

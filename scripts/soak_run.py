"""`python scripts/soak.py`: a long mixed run against a real server, with faults and hostile
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
import os
import re
import signal
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from soak_requests import Outcome, SoakRequest, send
from study_server import process_title, process_tree

SERVER_ARGS = ["--strategy", "dp2", "--api-server-count", "2", "--restart-dead-engines",
               "--max-model-len", "512", "--kv-cache-memory", "64MiB", "--dtype", "float32"]
MAX_RSS_GROWTH = 0.10


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
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:  # nosec B310
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
                outcomes[i] = await send(session, url, requests[i], start)
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
            with urllib.request.urlopen(url + "/health", timeout=30) as r:  # nosec B310
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

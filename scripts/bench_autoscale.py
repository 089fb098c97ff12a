"""`python scripts/bench_autoscale.py`: the autoscaler against a server sized for the peak
(issue 54). One load for both: Poisson arrivals at --rate requests/s for --phase-seconds, then
twice that rate, then --rate again (random prompts, greedy, streamed), served by

- peak: `parashift run --strategy dp{max}`, every rank up all along;
- autoscaled: `dp{min}` with `--data-parallel-size-min {min} --data-parallel-size-max {max}`
  and the --autoscale-* windows given here (short, so that a run of minutes shows them act).

Per server: TTFT p50 / p99 of all requests and of each phase, total tok/s, failed requests,
when the size changed, and rank-seconds: the DP size that /metrics reports (every rank of the
deployment, starting and draining ones included), integrated over the load's span. The two
servers alternate --rounds times, on one machine, one at a time.

    python scripts/bench_autoscale.py [--rate 0.6] [--phase-seconds 30] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess  # nosec B404: starts parashift's own servers
import sys
import tempfile
import threading
import time
import urllib.request

from parashift.bench.datasets import random_requests
from parashift.bench.metrics import RequestRecord
from parashift.bench.serve_client import run_load

PORT = 8044
DP_SIZE = re.compile(r"^parashift_data_parallel_size (\S+)$", re.MULTILINE)


def get(path: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=timeout) as r:  # nosec B310
        return r.read().decode()


def start(args: list[str], log: str) -> subprocess.Popen:
    with open(log, "w") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(  # nosec B603: our own CLI, no shell
            [sys.executable, "-m", "parashift.cli", "run", "--port", str(PORT), *args],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}; see {log}")
        try:
            get("/health", 1.0)
            return proc
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"server not healthy in 600 s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class RankSeconds(threading.Thread):
    """The DP size on /metrics, sampled every 0.2 s and integrated; its changes, timed."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.done = threading.Event()
        self.total = 0.0
        self.changes: list[tuple[float, int]] = []

    def run(self) -> None:
        begin = last = time.monotonic()
        size = None
        while True:
            m = DP_SIZE.search(get("/metrics"))
            now = time.monotonic()
            if size is not None:
                self.total += size * (now - last)
            new = int(float(m.group(1))) if m else 0
            if new != size:
                self.changes.append((round(now - begin, 1), new))
            size, last = new, now
            if self.done.wait(0.2):
                return


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def load(rate: float, seconds: float, input_len: int, output_len: int, seed: int
         ) -> tuple[list[list[RequestRecord]], float]:
    """The three phases, back to back: their records and the whole span in seconds."""
    phases = []
    begin = time.perf_counter()
    for k, r in enumerate((rate, 2 * rate, rate)):
        n = max(1, round(r * seconds))
        requests = random_requests(n, (input_len, input_len), (output_len, output_len), 32000,
                                   seed + k)
        records, _ = asyncio.run(run_load(f"http://127.0.0.1:{PORT}", None, requests, r,
                                          seed=seed + k))
        phases.append(records)
    return phases, time.perf_counter() - begin


def one_run(name: str, server_args: list[str], a: argparse.Namespace, log: str) -> dict:
    proc = start(server_args, log)
    try:
        sampler = RankSeconds()
        sampler.start()
        phases, span = load(a.rate, a.phase_seconds, a.input_len, a.output_len, a.seed)
        sampler.done.set()
        sampler.join()
    finally:
        stop(proc)
    every = [r for p in phases for r in p]
    ok = [r for r in every if r.ok]
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    return {
        "server": name, "requests": len(every), "failed": len(every) - len(ok),
        "ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": percentile(ttft, 0.99),
        "ttft_p50_ms_by_phase": [statistics.median([r.ttft * 1000 for r in p if r.ok])
                                 for p in phases],
        "total_tok_s": sum(r.prompt_len + r.generated for r in ok) / span,
        "span_s": span, "rank_seconds": sampler.total, "dp_size_changes": sampler.changes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=0.6, help="requests/s of the low phases")
    ap.add_argument("--phase-seconds", type=float, default=30.0)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--min", type=int, default=1)
    ap.add_argument("--max", type=int, default=2)
    ap.add_argument("--autoscale-up-tokens", type=int, default=512)
    ap.add_argument("--autoscale-up-window", type=float, default=1.0)
    ap.add_argument("--autoscale-idle-window", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-json", default=None)
    a = ap.parse_args()
    common = ["--max-model-len", "1024", "--no-enable-prefix-caching"]
    servers = {
        "peak": [*common, "--strategy", f"dp{a.max}"],
        "autoscaled": [*common, "--strategy", f"dp{a.min}",
                       "--data-parallel-size-min", str(a.min),
                       "--data-parallel-size-max", str(a.max),
                       "--autoscale-up-tokens", str(a.autoscale_up_tokens),
                       "--autoscale-up-window", str(a.autoscale_up_window),
                       "--autoscale-idle-window", str(a.autoscale_idle_window)],
    }
    results = []
    logs = tempfile.mkdtemp(prefix="bench-autoscale-")  # kept: the servers' logs
    print(f"server logs in {logs}", file=sys.stderr)
    for k in range(a.rounds):
        for name, args in servers.items():
            print(f"round {k + 1}: {name} ...", file=sys.stderr, flush=True)
            r = one_run(name, args, a, os.path.join(logs, f"{name}-{k}.log"))
            r["round"] = k + 1
            results.append(r)
            print(f"{name:>10} round {k + 1}: TTFT p50 {r['ttft_p50_ms']:.0f} ms "
                  f"(phases {', '.join(f'{t:.0f}' for t in r['ttft_p50_ms_by_phase'])}), "
                  f"p99 {r['ttft_p99_ms']:.0f} ms, {r['total_tok_s']:.0f} tok/s, "
                  f"{r['failed']}/{r['requests']} failed, rank-seconds "
                  f"{r['rank_seconds']:.1f} over {r['span_s']:.1f} s, DP size (at s, size) "
                  f"{r['dp_size_changes']}", flush=True)
    if a.save_json:
        with open(a.save_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

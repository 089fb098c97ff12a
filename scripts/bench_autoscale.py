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

    python scripts/bench_autoscale.py [--rate 0.6] [--phase-seconds 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import threading
import time
import urllib.request

from study_server import running_server

from parashift.bench.datasets import random_requests
from parashift.bench.metrics import RequestRecord, summarize
from parashift.bench.serve_client import run_load

DP_SIZE = re.compile(r"^parashift_data_parallel_size (\S+)$", re.MULTILINE)


class RankSeconds(threading.Thread):
    """The DP size on the server's /metrics, sampled every 0.2 s and integrated; its changes,
    timed."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url + "/metrics"
        self.done = threading.Event()
        self.total = 0.0
        self.changes: list[tuple[float, int]] = []

    def run(self) -> None:
        begin = last = time.monotonic()
        size = None
        while True:
            with urllib.request.urlopen(self.url, timeout=5) as r:  # nosec B310: loopback
                m = DP_SIZE.search(r.read().decode())
            now = time.monotonic()
            if size is not None:
                self.total += size * (now - last)
            new = int(float(m.group(1))) if m else 0
            if new != size:
                self.changes.append((round(now - begin, 1), new))
            size, last = new, now
            if self.done.wait(0.2):
                return


def load(url: str, a: argparse.Namespace) -> tuple[list[list[RequestRecord]], float]:
    """The three phases, back to back: their records and the whole span in seconds."""
    phases = []
    begin = time.perf_counter()
    for k, rate in enumerate((a.rate, 2 * a.rate, a.rate)):
        requests = random_requests(max(1, round(rate * a.phase_seconds)),
                                   (a.input_len, a.input_len), (a.output_len, a.output_len),
                                   32000, a.seed + k)
        records, _ = asyncio.run(run_load(url, None, requests, rate, seed=a.seed + k))
        phases.append(records)
    return phases, time.perf_counter() - begin


def one_run(name: str, run_args: list[str], a: argparse.Namespace) -> dict:
    with running_server(None, run_args) as server:
        sampler = RankSeconds(server.url)
        sampler.start()
        phases, span = load(server.url, a)
        sampler.done.set()
        sampler.join()
    summary = summarize([r for p in phases for r in p], span)
    return {"server": name, "requests": summary["completed"] + summary["failed"],
            "failed": summary["failed"], "ttft_p50_ms": summary["ttft_ms"]["median"],
            "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "ttft_p50_ms_by_phase": [summarize(p, span)["ttft_ms"]["median"] for p in phases],
            "total_tok_s": summary["total_token_throughput"], "span_s": span,
            "rank_seconds": sampler.total, "dp_size_changes": sampler.changes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=0.6, help="requests/s of the low phases")
    ap.add_argument("--phase-seconds", type=float, default=30.0)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--min", type=int, default=1)
    ap.add_argument("--max", type=int, default=2)
    ap.add_argument("--autoscale-up-tokens", type=int, default=512)
    ap.add_argument("--autoscale-up-window", type=float, default=3.0)
    ap.add_argument("--autoscale-idle-window", type=float, default=15.0)
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
    for k in range(a.rounds):
        for name, args in servers.items():
            print(f"round {k + 1}: {name} ...", file=sys.stderr, flush=True)
            r = one_run(name, args, a)
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

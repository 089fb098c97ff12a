"""`python scripts/bench_pd.py`: prefill/decode pools against data parallel on the same cores
(issue 57). One workload for both: --streams clients each keep a stream of --stream-out
tokens in progress (16-token prompts, back to back), while prompts of --prompt-len tokens
(--prompt-out tokens each) arrive as a Poisson process at --prompt-rate per second (the
defaults keep streams running all through the arrivals). Served by

- `parashift run --strategy p1xd1`: the prompts prefill on dp0, every decode runs on dp1;
- `parashift run --strategy dp2`: both ranks prefill and decode (the router balances them).

Per server: the streams' inter-token latency p50 / p99 / p99.9 / max and the count of gaps
over 200 ms (every gap between chunks of the stream requests after their first token), their
TPOT, the long prompts' TTFT p50 / p99,
total output tok/s, the gap between a long prompt's first and second tokens (with p1xd1 the
hand-off sits there: the first token streams from the prefill rank), and for p1xd1 the KV
handed over: bytes per block and load milliseconds per hand-off (the decode rank's tier
counters). The servers alternate --rounds times,
one at a time; random token ids, greedy, ignore_eos.

    python scripts/bench_pd.py [--streams 8] [--prompt-rate 0.5] [--prompts 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import urllib.request

import numpy as np
from study_server import running_server, warm_up

from parashift.bench.datasets import random_requests
from parashift.bench.metrics import RequestRecord, distribution
from parashift.bench.serve_client import run_load

VOCAB = 49152  # SmolLM2's


def metric(url: str, name: str, labels: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:  # nosec B310
        text = r.read().decode()
    m = re.search(rf"^{name}{{{labels}}} (\S+)$", text, re.MULTILINE)
    return float(m[1]) if m else 0.0


async def workload(url: str, a: argparse.Namespace, seed: int) -> dict:
    streams = random_requests(a.streams * a.stream_turns, (16, 16), (a.stream_out, a.stream_out),
                              VOCAB, seed)
    # client c's turns follow each other: a stream is always in progress on each
    follows = [None if i < a.streams else i - a.streams for i in range(len(streams))]
    prompts = random_requests(a.prompts, (a.prompt_len, a.prompt_len),
                              (a.prompt_out, a.prompt_out), VOCAB, seed + 1)
    (stream_records, stream_s), (prompt_records, _) = await asyncio.gather(
        run_load(url, None, streams, float("inf"), follows=follows),
        run_load(url, None, prompts, a.prompt_rate, seed=seed))
    return summary(stream_records, prompt_records, stream_s)


def summary(streams: list[RequestRecord], prompts: list[RequestRecord], seconds: float) -> dict:
    failed = sum(not r.ok for r in streams + prompts)
    gaps = np.array([g for r in streams if r.ok for g in r.itl])
    itl = distribution(gaps.tolist())
    tpot = distribution([t for r in streams if (t := r.tpot) is not None])
    ttft = distribution([r.ttft for r in prompts if r.ok and r.ttft is not None])
    # p1xd1: the hand-off (the KV stored, loaded, the request moved) sits between a prompt's
    # first token (from the prefill rank) and its second (from the decode rank)
    second = distribution([r.itl[0] for r in prompts if r.ok and r.itl])
    tokens = sum(r.generated for r in streams + prompts if r.ok)
    # A prompt's prefill stalls the streams beside it for a few gaps in thousands: p99 sits at
    # the edge of them, so the tail and the count of stalled gaps are reported too.
    return {"itl_p50_ms": itl.get("median"), "itl_p99_ms": itl.get("p99"),
            "itl_p999_ms": float(np.percentile(gaps, 99.9) * 1e3) if len(gaps) else None,
            "itl_max_ms": float(gaps.max() * 1e3) if len(gaps) else None,
            "gaps_over_200ms": int((gaps > 0.2).sum()), "gaps": len(gaps),
            "stream_tpot_ms": tpot.get("median"), "prompt_ttft_p50_ms": ttft.get("median"),
            "prompt_ttft_p99_ms": ttft.get("p99"), "prompt_second_token_p50_ms":
            second.get("median"), "prompt_second_token_p99_ms": second.get("p99"),
            "output_tok_s": tokens / seconds,
            "failed": failed}


def handed_over(url: str) -> dict:
    loads = metric(url, "parashift_kv_tier_loads", 'engine="dp1",tier="host"')
    if not loads:
        return {}
    moved = metric(url, "parashift_kv_tier_bytes", 'direction="load",engine="dp1"')
    blocks = metric(url, "parashift_kv_tier_hit_blocks", 'engine="dp1",tier="host"')
    seconds = metric(url, "parashift_kv_tier_load_seconds", 'engine="dp1",tier="host"')
    # (the load time runs from the lookup to the blocks cached: a copy and the step it rides)
    return {"kv_loads": loads, "kv_bytes_per_block": moved / blocks,
            "kv_load_ms": 1e3 * seconds / loads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-out", type=int, default=256)
    ap.add_argument("--stream-turns", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--prompt-out", type=int, default=16)
    ap.add_argument("--prompt-rate", type=float, default=0.5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="a JSON file for every run")
    a = ap.parse_args()
    servers = {strategy: lambda s=strategy: running_server(a.model, ["--strategy", s])
               for strategy in ("p1xd1", "dp2")}
    alternate(a, servers, lambda url: handed_over(url))


def alternate(a: argparse.Namespace, servers: dict, extra) -> None:
    """Each server of `servers` (name -> a context manager that starts it) in turn, --rounds
    times, one at a time: warmed up, `workload` timed, `extra(url)` added; each run printed,
    and all written to --out."""
    runs = []
    for round_ in range(a.rounds):
        for name, start in servers.items():
            with start() as server:
                warm_up(server.url, VOCAB)
                result = asyncio.run(workload(server.url, a, seed=round_))
                result.update(extra(server.url), server=name, round=round_)
            runs.append(result)
            print(json.dumps(result), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()

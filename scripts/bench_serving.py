#!/usr/bin/env python
"""Serving throughput against the offline engine, in one run: the offline benchmark's workload
through `LLM.generate`, then the same requests sent at once over HTTP (streaming
/v1/completions with token-id prompts) to a `parashift run` server started by this script.

    python scripts/bench_serving.py                 # 32 prompts, 32:256 in, 32:128 out, bf16
    python scripts/bench_serving.py --repeat 3 --json out.json

Prints both throughputs, their ratio and TTFT / TPOT / end-to-end percentiles of the server.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import aiohttp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_offline import make_workload, parse_range  # noqa: E402


def percentiles(values: list[float]) -> dict[str, float]:
    arr = np.asarray(values) * 1e3
    return {"mean_ms": float(arr.mean()), "p50_ms": float(np.percentile(arr, 50)),
            "p90_ms": float(np.percentile(arr, 90)), "p99_ms": float(np.percentile(arr, 99))}


def offline(args, w) -> list[float]:
    from parashift import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in w.output_lens]
    llm.generate([[100 + i for i in range(16)]], SamplingParams(max_tokens=4), use_tqdm=False)
    times = []
    for _ in range(args.repeat):
        llm.engine.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(w.prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    del llm
    gc.collect()
    return times


async def one_request(session, url, prompt, max_tokens, record) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    first, chunks = None, 0
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"])
            if data["choices"] and data["choices"][0]["text"]:
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    record.append({"ttft": first - start, "e2e": end - start,
                   "tpot": (end - first) / max(1, max_tokens - 1), "chunks": chunks})


async def serve_once(base_url: str, w) -> tuple[float, list[dict]]:
    records: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one_request(session, f"{base_url}/v1/completions", p, n, records)
                               for p, n in zip(w.prompts, w.output_lens, strict=True)))
        return time.perf_counter() - start, records


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "parashift.cli", "run", "--port", str(port),
           "--dtype", args.dtype, *args.server_args.split()]
    if args.model:
        cmd.insert(4, args.model)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "is serving" in line:
            # Keep draining the server's output so that it never blocks on a full pipe.
            threading.Thread(target=_drain, args=(proc,), daemon=True).start()
            return proc, f"http://127.0.0.1:{port}"
    raise RuntimeError("the server did not start")


def _drain(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        if "WARNING" in line or "ERROR" in line:
            print("server:", line, end="", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len-range", type=parse_range, default=(32, 256))
    ap.add_argument("--output-len-range", type=parse_range, default=(32, 128))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--server-args", default="",
                    help="extra `parashift run` flags, e.g. '--strategy dp2' or '--threads 1'")
    ap.add_argument("--skip-offline", action="store_true", help="measure the server only")
    args = ap.parse_args()

    from transformers import AutoConfig

    from parashift.models.loader import resolve_model_path

    vocab = AutoConfig.from_pretrained(resolve_model_path(args.model)).vocab_size
    w = make_workload(args.num_prompts, args.input_len_range, args.output_len_range, vocab,
                      args.seed)
    print(f"workload: {len(w.prompts)} requests, {w.total_tokens} tokens "
          f"({w.output_tokens} output); dtype {args.dtype}", flush=True)
    off_times = []
    if not args.skip_offline:
        print("offline ...", flush=True)
        off_times = offline(args, w)
    print("server ...", flush=True)
    proc, url = start_server(args)
    try:
        asyncio.run(serve_once(url, make_workload(2, (16, 16), (4, 4), vocab, 1)))  # warm-up
        runs = []
        for _ in range(args.repeat):
            asyncio.run(_reset(url))
            runs.append(asyncio.run(serve_once(url, w)))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    serve_times = [t for t, _ in runs]
    # Latency percentiles of the run whose time is the median.
    records = sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2][1]
    srv_med = statistics.median(serve_times)
    off_med = statistics.median(off_times) if off_times else None
    result = {
        "server_args": args.server_args,
        "serve": {"elapsed_s": serve_times, "total_tokens_per_s": w.total_tokens / srv_med,
                  "output_tokens_per_s": w.output_tokens / srv_med,
                  "ttft": percentiles([r["ttft"] for r in records]),
                  "tpot": percentiles([r["tpot"] for r in records]),
                  "e2e": percentiles([r["e2e"] for r in records])},
        "workload": {"num_requests": len(w.prompts), "total_tokens": w.total_tokens,
                     "output_tokens": w.output_tokens},
    }
    if off_med is not None:
        result["offline"] = {"elapsed_s": off_times,
                             "total_tokens_per_s": w.total_tokens / off_med}
        result["ratio_serve_over_offline"] = off_med / srv_med
        print(f"offline : median {off_med:.2f} s (min {min(off_times):.2f}), "
              f"{result['offline']['total_tokens_per_s']:.1f} tok/s")
    print(f"serving : median {srv_med:.2f} s (min {min(serve_times):.2f}), "
          f"{result['serve']['total_tokens_per_s']:.1f} tok/s, "
          f"{result['serve']['output_tokens_per_s']:.1f} output tok/s")
    if off_med is not None:
        print(f"serving / offline throughput: {result['ratio_serve_over_offline']:.3f}")
    for name in ("ttft", "tpot", "e2e"):
        v = result["serve"][name]
        print(f"{name:5s} mean {v['mean_ms']:.0f} ms  p50 {v['p50_ms']:.0f}  p90 {v['p90_ms']:.0f}"
              f"  p99 {v['p99_ms']:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


async def _reset(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/reset_prefix_cache") as resp:
            resp.raise_for_status()


if __name__ == "__main__":
    sys.exit(main())

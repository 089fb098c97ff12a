#!/usr/bin/env python
"""Data-parallel scaling on CPU, interleaved so that a noisy machine hits every configuration
alike: each round starts a `parashift run` server per configuration, sends the same
decode-heavy workload at once over streaming HTTP, and stops it.

    python scripts/bench_dp_scaling.py --repeat 3    # dp1 1 core, dp2 1 core per rank, dp1 2 cores

Prints medians per configuration, throughput(dp2) / (2 x throughput(dp1, one core)), and the
offline decode step time at 1, the per-rank and the whole batch size, which bounds that
ratio, and the GEMMs' weight-streaming floor, which caps it."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(__file__))
from bench_offline import make_workload, parse_range  # noqa: E402
from bench_serving import _reset, serve_once, start_server  # noqa: E402

CONFIGS = {"dp1, 1 core": "--threads 1", "dp2, 1 core per rank": "--strategy dp2",
           "dp1, 2 cores": "--threads 2"}


def serve(args, server_args: str, w, vocab: int) -> float:
    proc, url = start_server(SimpleNamespace(model=args.model, dtype=args.dtype,
                                             server_args=server_args))
    try:
        asyncio.run(serve_once(url, make_workload(2, (16, 16), (4, 4), vocab, 1)))  # warm-up
        asyncio.run(_reset(url))
        return asyncio.run(serve_once(url, w))[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def step_costs(args, batches: tuple[int, ...], steps: int = 32, rounds: int = 2) -> dict:
    """Offline decode step time with one thread at each of `batches` sequences (best of
    `rounds`, interleaved), and the GEMM weight-streaming floor: every GEMM of the model at one
    row, which reads each weight once and does almost no arithmetic."""
    import torch

    from parashift import LLM, SamplingParams
    from parashift.layers.gemm import linear

    torch.set_num_threads(1)
    llm = LLM(args.model, dtype=args.dtype, num_threads=1)
    llm.generate([[100] * 16], SamplingParams(max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    step: dict[int, float] = {}
    for _ in range(rounds):
        for batch in batches:
            prompts = [[100 + i + j for j in range(16)] for i in range(batch)]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            ms = (time.perf_counter() - start) / steps * 1e3
            step[batch] = min(ms, step.get(batch, ms))
    gemms = [m for m in llm.engine.executor.worker.model.modules() if hasattr(m, "packed_weight")]
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in gemms)
    floor = float("inf")
    with torch.inference_mode():
        for _ in range(5):
            start = time.perf_counter()
            for m in gemms:
                x = torch.ones(1, m.weight.shape[1], dtype=m.weight.dtype)
                linear(x, m.weight, getattr(m, "bias", None), m.packed_weight)
            floor = min(floor, (time.perf_counter() - start) * 1e3)
    llm.shutdown()
    return {"step_ms": step, "gemm_floor_ms": floor, "gemm_weight_bytes": weight_bytes}


def efficiency_model(costs: dict, half: int, whole: int) -> dict:
    """step(B) ~ fixed + per_seq x B. dp2 runs two steps of `half` in the time dp1 runs one of
    `whole`, so the efficiency is step(whole) / (2 x step(half)) = (F + wc) / (2F + wc). The
    fixed part is at least the GEMM floor; with nothing else fixed, the ceiling is reached."""
    step = costs["step_ms"]
    per_seq = (step[whole] - step[half]) / (whole - half)
    fixed = step[half] - per_seq * half
    floor = costs["gemm_floor_ms"]
    return {"fixed_ms": fixed, "per_seq_ms": per_seq, "bound": step[whole] / (2 * step[half]),
            "ceiling": (floor + whole * per_seq) / (2 * floor + whole * per_seq),
            "per_seq_ms_needed_for_0.85": 0.7 * floor / (whole - 1.7 * half)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len-range", type=parse_range, default=(16, 16))
    ap.add_argument("--output-len-range", type=parse_range, default=(256, 256))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--offline-only", action="store_true",
                    help="only the offline step costs and the ceiling they give")
    args = ap.parse_args()

    from transformers import AutoConfig

    from parashift.models.loader import resolve_model_path

    vocab = AutoConfig.from_pretrained(resolve_model_path(args.model)).vocab_size
    w = make_workload(args.num_prompts, args.input_len_range, args.output_len_range, vocab, 0)
    print(f"workload: {len(w.prompts)} requests, {w.total_tokens} tokens; dtype {args.dtype}",
          flush=True)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for round_ in range(0 if args.offline_only else args.repeat):
        for name, server_args in CONFIGS.items():
            times[name].append(serve(args, server_args, w, vocab))
            print(f"round {round_ + 1}: {name}: {times[name][-1]:.2f} s", flush=True)
    result = {"workload": {"num_requests": len(w.prompts), "total_tokens": w.total_tokens},
              "configs": {}}
    if not args.offline_only:
        for name, ts in times.items():
            tput = w.total_tokens / statistics.median(ts)
            result["configs"][name] = {"server_args": CONFIGS[name], "elapsed_s": ts,
                                       "total_tokens_per_s": tput}
            print(f"{name:24s} median {statistics.median(ts):6.2f} s (min {min(ts):6.2f}) "
                  f"{tput:7.1f} tok/s")
        dp1 = result["configs"]["dp1, 1 core"]["total_tokens_per_s"]
        dp2 = result["configs"]["dp2, 1 core per rank"]["total_tokens_per_s"]
        result["efficiency"] = dp2 / (2 * dp1)
        print(f"scaling efficiency dp2 / (2 x dp1): {result['efficiency']:.2f}")
    # Each dp2 rank decodes half the batch; a step's weight streaming costs the same at any
    # batch, so step(B) / (2 x step(B/2)) bounds the efficiency.
    half, whole = len(w.prompts) // 2, len(w.prompts)
    costs = step_costs(args, (1, half, whole))
    model = efficiency_model(costs, half, whole)
    result["offline"] = {**costs, **model}
    step = costs["step_ms"]
    print(f"offline decode step, 1 thread: {step[1]:.1f} ms at 1 sequence, {step[half]:.1f} ms "
          f"at {half}, {step[whole]:.1f} ms at {whole} -> bound {model['bound']:.2f}")
    print(f"  = {model['fixed_ms']:.1f} ms per step + {model['per_seq_ms']:.2f} ms per sequence;"
          f" the GEMMs alone stream {costs['gemm_weight_bytes'] / 1e6:.0f} MB of weights in "
          f"{costs['gemm_floor_ms']:.1f} ms")
    print(f"  ceiling with only that floor fixed: {model['ceiling']:.2f}; 0.85 needs "
          f">= {model['per_seq_ms_needed_for_0.85']:.2f} ms per sequence")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

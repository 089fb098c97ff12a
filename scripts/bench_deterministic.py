"""What --deterministic costs (issue 55): W1-decode (32 requests, 16 prompt + 256 output tokens)
and a prefill-heavy mix (32 requests, prompts U[512, 1024], 8 output tokens) on SmolLM2 in
bf16, offline, the default engine against a --deterministic one, alternated in one sitting
(both loaded at once, one run of each in turn).

  python scripts/bench_deterministic.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from parashift import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "shared", "peers"))
from workload import get_workload, make_requests  # noqa: E402


def workloads() -> dict[str, tuple[list[list[int]], list[SamplingParams], str]]:
    """name -> (prompts, params, which tokens count): output tok/s for decode, total else."""
    out = {}
    decode = get_workload("W1-decode").requests
    out["W1-decode"] = ([list(r.prompt_token_ids) for r in decode],
                        [SamplingParams(temperature=0, max_tokens=r.output_len,
                                        ignore_eos=True) for r in decode], "output")
    prefill = make_requests(32, (512, 1024), (8, 8), seed=55)
    out["prefill-mix"] = ([list(r.prompt_token_ids) for r in prefill],
                          [SamplingParams(temperature=0, max_tokens=r.output_len,
                                          ignore_eos=True) for r in prefill], "total")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--cpu-kernels", default="native",
                    help="a gcc -march to build the kernels for (haswell: AVX2 only)")
    args = ap.parse_args()
    engines = {mode: LLM(args.model, dtype="bfloat16", max_model_len=1280, max_num_seqs=256,
                         enable_prefix_caching=False, deterministic=mode == "deterministic",
                         cpu_kernels=args.cpu_kernels)
               for mode in ("default", "deterministic")}
    rates: dict[tuple[str, str], list[float]] = {}
    for name, (prompts, params, counted) in workloads().items():
        tokens = sum(p.max_tokens for p in params) + (
            sum(map(len, prompts)) if counted == "total" else 0)
        for llm in engines.values():  # warm-up
            llm.generate(prompts[:4], params[:4], use_tqdm=False)
        for rep in range(args.reps):
            for mode, llm in engines.items():
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                rate = tokens / (time.perf_counter() - start)
                rates.setdefault((name, mode), []).append(rate)
                print(f"{name} {mode} rep {rep + 1}/{args.reps}: {rate:.1f} {counted} tok/s",
                      flush=True)
    for name in workloads():
        base, det = rates[(name, "default")], rates[(name, "deterministic")]
        print(json.dumps({"workload": name, "default_min": round(min(base), 1),
                          "default_median": round(statistics.median(base), 1),
                          "deterministic_min": round(min(det), 1),
                          "deterministic_median": round(statistics.median(det), 1),
                          "ratio_median": round(statistics.median(det) /
                                                statistics.median(base), 3)}))
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()

"""W1-decode (../shared/peers: 32 requests, 16 prompt + 256 output tokens, greedy, ignore_eos)
through `LLM.generate` in this process: SmolLM2 in bf16, prefix caching off; the output tok/s of
each run after a warm-up. For A/B studies of a kernel change: run it once per build, the builds
alternated (the kernels rebuild when their sources change).

    python scripts/w1_decode_rate.py [--runs 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from parashift import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "shared", "peers"))
from workload import get_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)  # the GEMM paths and the layer choice it loads
    requests = get_workload("W1-decode").requests
    prompts = [list(r.prompt_token_ids) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    tokens = sum(p.max_tokens for p in params)
    llm = LLM(args.model, dtype="bfloat16", max_model_len=1024, max_num_seqs=256,
              enable_prefix_caching=False)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)
    rates = []
    for _ in range(args.runs):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(tokens / (time.perf_counter() - start))
    print("W1-decode output tok/s:", " ".join(f"{r:.1f}" for r in rates))
    llm.shutdown()


if __name__ == "__main__":
    main()

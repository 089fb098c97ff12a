#!/usr/bin/env python
"""Tensor parallel on CPU: per-step decode latency and throughput of tp1 (one core) and tp2
(two worker processes, one core each) on a random Llama big enough for compute and weight
streaming to dominate, and the share of tp2's decode time spent in all-reduce. Every tp > 1 is
measured twice: all-reduce through shared memory (the default) and through gloo only.

    python scripts/bench_tensor_parallel.py --repeat 3
    python scripts/bench_tensor_parallel.py --model /path/to/hf-folder --tp 1,2,4

Decode time per step = (time for N tokens - time for 1 token) / (N - 1): prefill excluded."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time


def make_model(folder: str, args) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from parashift.models.loader import resolve_model_path

    if os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        return folder
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model.save_pretrained(folder)
    # Token ids only matter; SmolLM2's tokenizer (49k entries) detokenizes any id below that.
    AutoTokenizer.from_pretrained(resolve_model_path(None)).save_pretrained(folder)
    print(f"random Llama: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters "
          f"-> {folder}", flush=True)
    return folder


def measure(model: str, tp: int, args, shm: bool = True) -> dict:
    from parashift import LLM, SamplingParams

    os.environ["PARASHIFT_SHM_ALL_REDUCE"] = "1" if shm else "0"  # read when workers start
    llm = LLM(model, dtype="float32", tensor_parallel_size=tp, max_model_len=512,
              kv_cache_memory=256 << 20, num_threads=1 if tp == 1 else None)
    prompts = [[100 + 7 * i + j for j in range(16)] for i in range(args.batch)]

    def run(tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.engine.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    executor = llm.engine.executor
    comm = (lambda: executor.collective_rpc("take_comm_stats")[0]) if tp > 1 else (lambda: None)
    run(2)  # warm-up
    steps, comm_runs = [], []
    for _ in range(args.repeat):
        one = run(1)
        comm()
        many = run(args.steps)
        stats = comm()
        steps.append((many - one) / (args.steps - 1))
        if stats is not None:  # all-reduce seconds of tp rank 0 over the whole N-token run
            comm_runs.append((stats["seconds"] / many, stats["calls"] / args.steps))
    llm.shutdown()
    med = statistics.median(steps)
    out = {"tp": tp, "all_reduce": "none" if tp == 1 else "shm" if shm else "gloo",
           "step_ms": [s * 1e3 for s in steps], "median_step_ms": med * 1e3,
           "min_step_ms": min(steps) * 1e3, "decode_tokens_per_s": args.batch / med}
    if comm_runs:
        out["allreduce_fraction"] = statistics.median(f for f, _ in comm_runs)
        out["allreduces_per_step"] = comm_runs[0][1]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder; default: a random Llama")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    folder = args.model or make_model(os.path.join(tempfile.gettempdir(),
                                                   "parashift-bench-llama"), args)
    results = []
    for tp, shm in ((int(t), shm) for t in args.tp.split(",") for shm in (True, False)):
        if tp == 1 and not shm:
            continue
        label = f"tp{tp}" + ("" if tp == 1 else " shm" if shm else " gloo")
        print(f"{label} ...", flush=True)
        results.append(measure(folder, tp, args, shm))
        r = results[-1]
        extra = (f", all-reduce {100 * r['allreduce_fraction']:.1f}% of the run "
                 f"({r['allreduces_per_step']:.0f} per step)" if "allreduce_fraction" in r
                 else "")
        print(f"{label}: decode step median {r['median_step_ms']:.1f} ms (min "
              f"{r['min_step_ms']:.1f}), {r['decode_tokens_per_s']:.1f} tok/s at batch "
              f"{args.batch}{extra}", flush=True)
    base = results[0]["median_step_ms"]
    for r in results[1:]:
        print(f"speed-up tp{r['tp']} ({r['all_reduce']}) over tp{results[0]['tp']}: "
              f"{base / r['median_step_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(),
                       "cores": len(os.sched_getaffinity(0)), "batch": args.batch,
                       "model": folder, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

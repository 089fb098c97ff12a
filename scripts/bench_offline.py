#!/usr/bin/env python
"""Offline throughput: parashift `LLM.generate` against Hugging Face `generate` on the same
random workload, each also as a fraction of the best GEMM rate torch reaches on this machine.

    python scripts/bench_offline.py                      # 32 prompts, 32:256 in, 32:128 out
    python scripts/bench_offline.py --num-prompts 4 --input-len-range 16:32 \
        --output-len-range 8:16 --repeat 3 --json out.json
    python scripts/bench_offline.py --skip-hf --threads 2

Every request is greedy with ignore_eos, so both systems produce exactly the requested number
of tokens. Total tokens = sum of prompt lengths + sum of requested output lengths, the same for
both systems; HF's padding and the extra tokens a static batch generates for its shorter
requests are not counted as useful output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from parashift.bench.hf_baseline import generate_batch, load_hf

# Roofline GEMM shapes: rows M (tokens) x reduction K (SmolLM2 hidden size) x columns N.
ROOFLINE_M = (256, 1024, 2048)
ROOFLINE_K = 576
ROOFLINE_N = (1536, 576)


def parse_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--hf-dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="dtype of the transformers baseline (default: --dtype); float32 is its "
                        "fastest setting on CPUs without bf16 dot-product instructions")
    p.add_argument("--device", default=None, help="cpu or cuda (default: parashift's default)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len-range", type=parse_range, default=(32, 256), metavar="LO:HI")
    p.add_argument("--output-len-range", type=parse_range, default=(32, 128), metavar="LO:HI")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload")
    p.add_argument("--hf-batch-size", type=int, default=32,
                   help="requests per static left-padded HF batch (default 32)")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed runs per system; report min/median (tokens/s from the median)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: leave torch's setting alone)")
    p.add_argument("--skip-hf", action="store_true", help="do not run the HF baseline")
    p.add_argument("--skip-roofline", action="store_true", help="do not time the GEMMs")
    p.add_argument("--json", metavar="FILE", default=None, help="write all numbers here")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.hf_batch_size < 1 or args.repeat < 1:
        p.error("--num-prompts, --hf-batch-size and --repeat must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    return args


# ---------------------------------------------------------------------------- workload

@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def make_workload(n: int, in_range: tuple[int, int], out_range: tuple[int, int],
                  vocab_size: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(in_range[0], in_range[1] + 1, size=n)
    out_lens = rng.integers(out_range[0], out_range[1] + 1, size=n)
    lo, hi = (100, vocab_size - 100) if vocab_size > 300 else (0, vocab_size)
    prompts = [rng.integers(lo, hi, size=int(k)).tolist() for k in in_lens]
    return Workload(prompts, [int(k) for k in out_lens])


# ---------------------------------------------------------------------------- timing helpers

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(times: list[float], w: Workload) -> dict[str, Any]:
    med = statistics.median(times)
    return {
        "elapsed_s": times,
        "elapsed_min_s": min(times),
        "elapsed_median_s": med,
        "requests_per_s": len(w.prompts) / med,
        "total_tokens_per_s": w.total_tokens / med,
        "output_tokens_per_s": w.output_tokens / med,
    }


# ---------------------------------------------------------------------------- parashift

def bench_parashift(args: argparse.Namespace, w: Workload) -> tuple[dict[str, Any], list]:
    from parashift import LLM, SamplingParams

    kwargs: dict[str, Any] = {"dtype": args.dtype}
    if args.device:
        kwargs["device"] = args.device
    if args.threads is not None:
        kwargs["num_threads"] = args.threads
    t0 = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    build_s = time.perf_counter() - t0
    device = llm.config.device.torch_device

    def params(k: int) -> SamplingParams:
        return SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)

    # Warm-up: a couple of short requests off the workload's token ids.
    warm = [[100 + i for i in range(16)], [200 + i for i in range(24)]]
    llm.generate(warm, [params(8), params(8)], use_tqdm=False)

    times, outputs = [], None
    for _ in range(args.repeat):
        reset = getattr(llm.engine, "reset_prefix_cache", None)
        if reset is not None:  # repeats must not hit the previous run's cached prompts
            reset()
        sync(device)
        t0 = time.perf_counter()
        outputs = llm.generate(w.prompts, [params(k) for k in w.output_lens], use_tqdm=False)
        sync(device)
        times.append(time.perf_counter() - t0)
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    got = [len(t) for t in token_ids]
    if got != w.output_lens:
        bad = next(i for i, (g, e) in enumerate(zip(got, w.output_lens, strict=True)) if g != e)
        raise SystemExit(f"parashift request {bad} produced {got[bad]} tokens, "
                         f"expected {w.output_lens[bad]}")
    result = summarize(times, w)
    result["construct_s"] = build_s
    result["device"] = str(device)
    result["dtype"] = str(llm.config.model.dtype).removeprefix("torch.")
    del llm
    return result, token_ids


# ---------------------------------------------------------------------------- Hugging Face

def bench_hf(args: argparse.Namespace, folder: str, w: Workload, device: torch.device
             ) -> tuple[dict[str, Any], list, int]:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dtype = getattr(torch, args.hf_dtype or args.dtype)
    t0 = time.perf_counter()
    model, tok = load_hf(folder, dtype, device)
    num_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    load_s = time.perf_counter() - t0
    generate_batch(model, tok, [[100 + i for i in range(16)], [200 + i for i in range(24)]],
                      [8, 8], device)  # warm-up
    bs = args.hf_batch_size
    times, token_ids = [], []
    for _ in range(args.repeat):
        token_ids = []
        sync(device)
        t0 = time.perf_counter()
        for s in range(0, len(w.prompts), bs):
            token_ids += generate_batch(model, tok, w.prompts[s:s + bs],
                                        w.output_lens[s:s + bs], device)
        sync(device)
        times.append(time.perf_counter() - t0)
    result = summarize(times, w)
    result["load_s"] = load_s
    result["batch_size"] = bs
    del model
    return result, token_ids, num_params


def count_params_only(folder: str) -> int:
    """Parameter count without timing HF (for --skip-hf): build the model on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------- roofline

def time_op(fn, device: torch.device, min_time: float = 0.1, trials: int = 5) -> float:
    """Best seconds per call of `fn`."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(min_time / once))
    best = float("inf")
    for _ in range(trials):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def measure_roofline(device: torch.device) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for m in ROOFLINE_M:
        for n in ROOFLINE_N:
            x = torch.randn(m, ROOFLINE_K, generator=g).to(device, torch.bfloat16)
            w = torch.randn(n, ROOFLINE_K, generator=g).to(device, torch.bfloat16)
            flops = 2.0 * m * n * ROOFLINE_K
            variants = {
                "bf16": lambda x=x, w=w: F.linear(x, w),
                "bf16_via_fp32": lambda x=x, w=w: F.linear(x.float(), w.float()).to(torch.bfloat16),
            }
            for name, fn in variants.items():
                with torch.inference_mode():
                    s = time_op(fn, device)
                rows.append({"variant": name, "M": m, "K": ROOFLINE_K, "N": n,
                             "seconds": s, "gflops": flops / s / 1e9})
    best = max(rows, key=lambda r: r["gflops"])
    return {"shapes": rows, "best_gflops": best["gflops"],
            "best": {k: best[k] for k in ("variant", "M", "K", "N")}}


# ---------------------------------------------------------------------------- reporting

def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_model": cpu, "nproc": os.cpu_count(),
            "nproc_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None,
            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of output tokens inside the common greedy prefix of the two systems."""
    same = 0
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        same += k
    return same / max(1, sum(len(x) for x in a))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    import transformers
    from transformers import AutoConfig

    from parashift.models.loader import resolve_model_path

    folder = resolve_model_path(args.model)
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    w = make_workload(args.num_prompts, args.input_len_range, args.output_len_range,
                      vocab_size, args.seed)
    print(f"workload: {len(w.prompts)} requests, {w.prompt_tokens} prompt + {w.output_tokens} "
          f"output = {w.total_tokens} tokens (seed {args.seed}); dtype {args.dtype}; "
          f"torch threads {torch.get_num_threads()}", flush=True)

    print("parashift ...", flush=True)
    ps, ps_ids = bench_parashift(args, w)
    device = torch.device(ps["device"])
    torch.manual_seed(0)

    hf, hf_ids, num_params = None, None, None
    if not args.skip_hf:
        print("transformers ...", flush=True)
        hf, hf_ids, num_params = bench_hf(args, folder, w, device)
    else:
        num_params = count_params_only(folder)

    roof = None
    if not args.skip_roofline:
        print("roofline GEMMs ...", flush=True)
        roof = measure_roofline(device)

    systems = {"parashift": ps} | ({"hf": hf} if hf else {})
    for r in systems.values():
        r["model_gflops"] = 2.0 * num_params * r["total_tokens_per_s"] / 1e9
        r["fraction_of_roofline"] = (r["model_gflops"] / roof["best_gflops"]) if roof else None

    ratio = ps["total_tokens_per_s"] / hf["total_tokens_per_s"] if hf else None
    agreement = prefix_agreement(ps_ids, hf_ids) if hf else None

    print()
    print(f"model {os.path.basename(folder.rstrip('/'))}: {num_params / 1e6:.1f} M params, "
          f"{args.dtype}, device {device}; torch {torch.__version__}, "
          f"transformers {transformers.__version__}; threads {torch.get_num_threads()}")
    print(f"workload: {len(w.prompts)} req, in {args.input_len_range[0]}:"
          f"{args.input_len_range[1]}, out {args.output_len_range[0]}:"
          f"{args.output_len_range[1]}, total {w.total_tokens} tok "
          f"({w.output_tokens} out); repeat {args.repeat}")
    hdr = (f"{'system':<22}{'min s':>9}{'median s':>10}{'req/s':>9}{'tot tok/s':>11}"
           f"{'out tok/s':>11}{'GFLOP/s':>9}{'roofline':>10}")
    print(hdr)
    for name, r in systems.items():
        frac = f"{100 * r['fraction_of_roofline']:.1f}%" if roof else "-"
        label = name if name != "hf" else f"hf {args.hf_dtype or args.dtype} bs{r['batch_size']}"
        print(f"{label:<22}{r['elapsed_min_s']:>9.3f}{r['elapsed_median_s']:>10.3f}"
              f"{r['requests_per_s']:>9.2f}{r['total_tokens_per_s']:>11.1f}"
              f"{r['output_tokens_per_s']:>11.1f}{r['model_gflops']:>9.1f}{frac:>10}")
    if roof:
        b = roof["best"]
        print(f"roofline: {roof['best_gflops']:.1f} GFLOP/s ({b['variant']} GEMM "
              f"{b['M']}x{b['K']}x{b['N']})")
    if hf:
        print(f"parashift / hf total tok/s: {ratio:.2f}x; greedy outputs agree on "
              f"{100 * agreement:.1f}% of tokens (common prefix)")

    if args.json:
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
        report = {
            "settings": settings,
            "model_folder": folder,
            "num_params": num_params,
            "workload": {"num_requests": len(w.prompts), "prompt_tokens": w.prompt_tokens,
                         "output_tokens": w.output_tokens, "total_tokens": w.total_tokens,
                         "prompt_lens": [len(p) for p in w.prompts],
                         "output_lens": w.output_lens},
            "parashift": ps, "hf": hf, "roofline": roof,
            "ratio_parashift_over_hf_total_tokens_per_s": ratio,
            "greedy_prefix_agreement": agreement,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "numpy": np.__version__},
            "machine": machine_info(),
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

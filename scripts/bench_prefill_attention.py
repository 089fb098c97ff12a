"""The prefill attention kernels alone, at SmolLM2's shape (9 query and 3 kv heads of 64, a
paged bf16 cache of 16-token blocks), one causal chunk per sequence over its whole prompt: the
tiled kernel as the default mode runs it (AMX tiles where the CPU has them, else the same
vdpbf16ps blocks as the next), the tiled kernel in the decode kernel's order (--deterministic),
and every token a decode query over its own prefix (--deterministic where the tiled kernel
does not run). Best of --reps, milliseconds.

  python scripts/bench_prefill_attention.py --tokens 256 512 1024 --seqs 1 4
"""

from __future__ import annotations

import argparse
import time

import torch

from parashift.layers.kernel_dispatch import cpu_ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def time_case(ops, seqs: int, n: int, reps: int, g: torch.Generator) -> dict[str, float]:
    """Each kernel's best time over `seqs` prompts of `n` tokens, in milliseconds."""
    per_seq = n // BLOCK + 1
    key_cache = torch.randn(seqs * per_seq, BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16()
    value_cache = torch.randn(key_cache.shape, generator=g).bfloat16()
    tables = torch.arange(seqs * per_seq, dtype=torch.int32).view(seqs, per_seq)
    query = torch.randn(seqs * n, HEADS, HEAD_DIM, generator=g).bfloat16()
    out = torch.empty_like(query)
    starts = torch.arange(0, (seqs + 1) * n, n, dtype=torch.int32)
    lens = torch.full((seqs,), n, dtype=torch.int32)
    token_tables = tables.repeat_interleave(n, 0).contiguous()
    token_lens = torch.arange(1, n + 1, dtype=torch.int32).repeat(seqs)
    return {
        "tiled": best_ms(lambda: ops.prefill_attention(
            out, query, key_cache, value_cache, tables, starts, lens, 0.125), reps),
        "tiled, decode order": best_ms(lambda: ops.prefill_attention(
            out, query, key_cache, value_cache, tables, starts, lens, 0.125,
            decode_order=True), reps),
        "per token": best_ms(lambda: ops.paged_decode_attention(
            out, query, key_cache, value_cache, token_tables, token_lens, None, 0.125), reps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    ops = cpu_ops()
    if ops is None or not ops.bf16_dot:
        raise SystemExit("the tiled prefill kernel needs the CPU kernels on AVX512-BF16")
    g = torch.Generator().manual_seed(0)
    for seqs in args.seqs:
        for n in args.tokens:
            times = time_case(ops, seqs, n, args.reps, g)
            print(f"{seqs} x {n} tokens, {torch.get_num_threads()} threads: " + ", ".join(
                f"{name} {ms:.2f} ms" for name, ms in times.items()), flush=True)


if __name__ == "__main__":
    main()

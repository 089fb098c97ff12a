"""How near the AMX tile peak a prefill chunk's GEMMs run on this CPU (issue 56).

The peak: a loop of TDPBF16PS on tile registers only (no memory operand; four accumulators,
two A and two B tiles, the register block our GEMM uses), compiled here with the system's C
compiler into a program of its own (not a library beside torch's OpenMP), on 1 and 2
threads. Then each decoder GEMM of the embedded SmolLM2 (QKV 960 x 576,
O 576 x 576, gate_up 3072 x 576, down 576 x 1536) at prefill rows, by our bf16 kernel and by
oneDNN's reordered weight, in GFLOP/s and as a share of the 2-thread peak (best of 5 calls;
the weight and the rows stay in cache, as in a prefill chunk that reuses them).

    python scripts/prefill_gemm_peak.py [--rows 256 512 1024]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time

import torch

PEAK_C = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16];
                 uint8_t rows[16]; } __attribute__((aligned(64))) TileConfig;

static long iters;

static void *loop(void *unused) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    __asm__ volatile("" : : "r"(&cfg) : "memory");  /* gcc 12 drops the stores otherwise */
    _tile_loadconfig(&cfg);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
    for (long i = 0; i < iters; ++i) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_release();
    return unused;
}

/* peak ITERS THREADS: seconds for ITERS rounds of 4 TDPBF16PS on each of THREADS threads */
int main(int argc, char **argv) {
    iters = atol(argv[1]);
    int threads = atoi(argv[2]);
    if (syscall(SYS_arch_prctl, 0x1023, 18)) { perror("arch_prctl"); return 1; }
    pthread_t ids[64];
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int t = 0; t < threads; ++t) pthread_create(&ids[t], NULL, loop, NULL);
    for (int t = 0; t < threads; ++t) pthread_join(ids[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.9f\n", (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec));
    return 0;
}
"""

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
FLOPS_PER_TDP = 2 * 16 * 16 * 32


def tile_peak() -> dict[int, float]:
    """GFLOP/s of the tile loop on 1 and 2 threads (best of 5)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "peak.c"), os.path.join(tmp, "peak")
        with open(src, "w") as f:
            f.write(PEAK_C)
        subprocess.run(["cc", "-O2", "-mamx-tile", "-mamx-bf16", "-pthread", src, "-o", exe],
                       check=True)

        def seconds(iters: int, threads: int) -> float:
            return float(subprocess.run([exe, str(iters), str(threads)], check=True,
                                        capture_output=True, text=True).stdout)

        iters, peaks = 2_000_000, {}
        for threads in (1, 2):
            best = min(seconds(iters, threads) for _ in range(5))
            peaks[threads] = 4 * FLOPS_PER_TDP * iters * threads / best / 1e9
    return peaks


def gemm_rates(rows: int) -> dict[str, dict[str, float]]:
    from parashift.layers.gemm import OneDnnGemm, OwnBf16Gemm

    out: dict[str, dict[str, float]] = {}
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        for path, gemm in (("own-bf16", OwnBf16Gemm(w)), ("onednn", OneDnnGemm(w))):
            gemm(x, None)
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                gemm(x, None)
                best = min(best, time.perf_counter() - start)
            out.setdefault(name, {})[path] = 2 * rows * n * k / best / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024])
    args = ap.parse_args()
    with open("/proc/cpuinfo") as f:
        if "amx_bf16" not in f.read():
            raise SystemExit("this CPU has no AMX tiles (no amx_bf16 in /proc/cpuinfo)")
    torch.set_num_threads(2)
    peaks = tile_peak()
    print(f"tile loop: {peaks[1]:,.0f} GFLOP/s on 1 thread, {peaks[2]:,.0f} on 2")
    for rows in args.rows:
        for name, rates in gemm_rates(rows).items():
            line = ", ".join(f"{path} {rate:,.0f} GFLOP/s ({rate / peaks[2]:.0%})"
                             for path, rate in rates.items())
            print(f"{rows} rows, {name}: {line}")


if __name__ == "__main__":
    main()

"""How near its CPU's peak a prefill chunk's GEMMs run (issue 56).

The peak: a loop of the instruction our GEMM runs on this CPU, on registers only (no memory
operand), compiled here with the system's C compiler into a program of its own (not a library
beside torch's OpenMP), on 1 and 2 threads: TDPBF16PS where the CPU has AMX tiles (four
accumulators, two A and two B tiles, the register block our GEMM uses), else VDPBF16PS
(AVX512-BF16: twelve independent accumulators). Then each decoder GEMM of the embedded SmolLM2
(QKV 960 x 576, O 576 x 576, gate_up 3072 x 576, down 576 x 1536) at prefill rows, by our bf16
kernel and by oneDNN's reordered weight, in GFLOP/s and as a share of the 2-thread peak (best
of 5 calls; the weight and the rows stay in cache, as in a prefill chunk that reuses them).

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

/* the kernel lets this process use the tile registers */
static int setup(void) { return syscall(SYS_arch_prctl, 0x1023, 18); }
"""

DOT_PEAK_C = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long iters;
static volatile float sink;

#define DP(c) c = _mm512_dpbf16_ps(c, a, b)

static void *loop(void *unused) {
    /* different starts: equal ones would be one chain to the compiler */
    __m512 c0 = _mm512_set1_ps(0), c1 = _mm512_set1_ps(1), c2 = _mm512_set1_ps(2),
           c3 = _mm512_set1_ps(3), c4 = _mm512_set1_ps(4), c5 = _mm512_set1_ps(5),
           c6 = _mm512_set1_ps(6), c7 = _mm512_set1_ps(7), c8 = _mm512_set1_ps(8),
           c9 = _mm512_set1_ps(9), c10 = _mm512_set1_ps(10), c11 = _mm512_set1_ps(11);
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f00);
    for (long i = 0; i < iters; ++i) {
        DP(c0); DP(c1); DP(c2); DP(c3); DP(c4); DP(c5);
        DP(c6); DP(c7); DP(c8); DP(c9); DP(c10); DP(c11);
        __asm__ volatile("" : "+v"(a), "+v"(b));  /* keeps the operands in registers */
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                             _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
    sink = _mm512_reduce_add_ps(s);
    return unused;
}

static int setup(void) { return 0; }
"""

# peak ITERS THREADS: seconds for ITERS rounds of a loop above on each of THREADS threads
MAIN_C = r"""
int main(int argc, char **argv) {
    iters = atol(argv[1]);
    int threads = atoi(argv[2]);
    if (setup()) { perror("setup"); return 1; }
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
# (what the loop is called, its source, compiler flags, FLOPs a round)
LOOPS = {"amx_bf16": ("tile loop", PEAK_C, ["-mamx-tile", "-mamx-bf16"], 4 * 2 * 16 * 16 * 32),
         "avx512_bf16": ("vdpbf16ps loop", DOT_PEAK_C, ["-mavx512f", "-mavx512bf16"],
                         12 * 2 * 32)}


def peak(flags: set[str]) -> tuple[str, dict[int, float]]:
    """The loop this CPU's GEMM runs on, and its GFLOP/s on 1 and 2 threads (best of 5)."""
    kind = next((k for k in LOOPS if k in flags), None)
    if kind is None:
        raise SystemExit("this CPU has neither AMX tiles nor AVX512-BF16 (/proc/cpuinfo)")
    name, source, cflags, flops = LOOPS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "peak.c"), os.path.join(tmp, "peak")
        with open(src, "w") as f:
            f.write(source + MAIN_C)
        subprocess.run(["cc", "-O2", *cflags, "-pthread", src, "-o", exe], check=True)

        def seconds(iters: int, threads: int) -> float:
            return float(subprocess.run([exe, str(iters), str(threads)], check=True,
                                        capture_output=True, text=True).stdout)

        iters, peaks = 20_000_000, {}
        for threads in (1, 2):
            best = min(seconds(iters, threads) for _ in range(5))
            peaks[threads] = flops * iters * threads / best / 1e9
    return name, peaks


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
        flags = set(f.read().split())
    torch.set_num_threads(2)
    name, peaks = peak(flags)
    print(f"{name}: {peaks[1]:,.0f} GFLOP/s on 1 thread, {peaks[2]:,.0f} on 2")
    for rows in args.rows:
        for name, rates in gemm_rates(rows).items():
            line = ", ".join(f"{path} {rate:,.0f} GFLOP/s ({rate / peaks[2]:.0%})"
                             for path, rate in rates.items())
            print(f"{rows} rows, {name}: {line}")


if __name__ == "__main__":
    main()

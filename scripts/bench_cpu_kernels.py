"""`python scripts/bench_cpu_kernels.py`: each compiled CPU kernel (`kernels/cpu`) against the torch
ops it replaces, on this CPU, at a decode step's shapes (the embedded SmolLM2's: 9 query and 3
kv heads of 64, hidden 576, intermediate 1536, vocabulary 49,152); in bf16 our GEMM too, where
this CPU has one, against oneDNN's reordered weight or (`--gemm-against inductor`) inductor's C++
GEMM template, and our weight-only int8 GEMM (`--quantization int8`) against torch's
`_weight_int8pack_mm`. Each call is timed with the
caches flushed first, as in a real step, where every other layer's weights and KV pass through
the caches between two calls of one layer's kernel."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer
from bench_kernels import KernelCase

from parashift.bench.options import SaveJson
from parashift.cli_options import fail, setup_logging

# our bf16 GEMM's instructions (CpuOps.bf16_gemm) as the GEMM rows name them
GEMM_KERNELS = {"amx": "AMX", "dpbf16": "vdpbf16ps", "fma": "FMA"}

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE, VOCAB, BLOCK = 9, 3, 64, 576, 1536, 49152, 16


def time_cold(fn: Callable[[], Any], reps: int, flush: Any) -> list[float]:
    """Seconds per call of `reps` calls, each after `flush` has passed through the caches."""
    fn()
    times = []
    for _ in range(reps):
        flush.add_(1)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def cases(batch: int, context: int, dtype: Any, gemm_against: str = "onednn"
          ) -> list[KernelCase]:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from parashift.layers.attention.backend import AttentionStepInputs
    from parashift.layers.attention.cpu_backend import CpuAttentionBackend
    from parashift.layers.attention.torch_backend import TorchAttentionBackend
    from parashift.layers.kernel_dispatch import cpu_ops
    from parashift.layers.norm import RMSNorm

    ops = cpu_ops()
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = 4 * batch * blocks_per_seq  # a cache larger than the batch's share of it
    kv_cache = tuple(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype)
                     for _ in range(2))
    table = np.random.default_rng(0).permutation(num_blocks)[: batch * blocks_per_seq]
    table = table.reshape(batch, blocks_per_seq)
    lens = np.full(batch, context)
    slots = torch.from_numpy(table[:, -1] * BLOCK + (context - 1) % BLOCK)
    step = AttentionStepInputs(np.arange(batch + 1), lens, lens - 1, table, slots, batch, BLOCK,
                               None, torch.device("cpu"))
    qkv = torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM).to(dtype)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    mine, torchs = CpuAttentionBackend(), TorchAttentionBackend()
    mine_md, torch_md = mine.build_metadata(step), torchs.build_metadata(step)
    out = [KernelCase(
        "decode attention + KV write", f"batch {batch}, context {context}, 9/3 heads x 64",
        lambda: mine.forward(q, k, v, kv_cache, mine_md, HEAD_DIM**-0.5),
        lambda: torchs.forward(q, k, v, kv_cache, torch_md, HEAD_DIM**-0.5), 0, 2e-2)]
    x, residual = torch.randn(batch, HIDDEN).to(dtype), torch.randn(batch, HIDDEN).to(dtype)
    norm = RMSNorm(HIDDEN, 1e-5, dtype)
    weight = norm.weight.data.copy_(torch.randn(HIDDEN))
    out.append(KernelCase("RMSNorm + residual", f"{batch} x {HIDDEN}",
                          lambda: ops.rms_norm(x, weight, 1e-5, residual)[0],
                          lambda: norm._norm(x + residual),  # the layer's own torch code
                          0, 5e-2))
    angles = torch.rand(batch, HEAD_DIM // 2) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rotated = qkv.clone()[:, : HEADS + KV_HEADS]

    def rotary_torch():
        x1, x2 = rotated.chunk(2, dim=-1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    out.append(KernelCase("rotary (neox, in place)", f"{batch} x {HEADS + KV_HEADS} x 64",
                          lambda: ops.rotary_(rotated, cos, sin), rotary_torch,
                          0, 0.0 if dtype == torch.bfloat16 else 1e-5))
    gate_up = torch.randn(batch, 2 * INTERMEDIATE).to(dtype)
    out.append(KernelCase("SiLU and mul", f"{batch} x {INTERMEDIATE}",
                          lambda: ops.silu_and_mul(gate_up),
                          lambda: F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:],
                          0, 5e-2))
    logits = torch.randn(batch, VOCAB).to(dtype)
    out.append(KernelCase("greedy argmax", f"{batch} x {VOCAB}", lambda: ops.argmax(logits),
                          lambda: logits.float().argmax(dim=-1), 0, 0.0))
    if dtype == torch.bfloat16 and ops.bf16_gemm is not None:
        out.extend(_gemm_cases(ops, batch, gemm_against))
    if dtype == torch.bfloat16 and ops.int8_gemm:
        out.extend(_int8_gemm_cases(batch, GEMM_KERNELS[ops.bf16_gemm]))
    return out


GEMM_SHAPES = {"QKV": (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), "O": (HIDDEN, HIDDEN),
               "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE),
               "LM head": (VOCAB, HIDDEN)}


def _int8_gemm_cases(batch: int, kernel: str) -> list[KernelCase]:
    """Our int8 GEMM against torch's on the same int8 weight (SmolLM2's decoder shapes: the LM
    head stays unquantized)."""
    import torch

    from parashift.layers.quantization import quantize, quantized_linear

    cases = []
    for name, (n, k) in GEMM_SHAPES.items():
        if name == "LM head":
            continue
        weight = torch.randn(n, k) * 0.05
        ours, torchs = quantize(weight, "int8"), quantize(weight, "int8", own_kernel=False)
        x = torch.randn(batch, k).bfloat16()
        cases.append(KernelCase(f"{name} int8 GEMM ({kernel})", f"{batch} x {k} -> {n}",
                                lambda x=x, q=ours: quantized_linear(x, q, None),
                                lambda x=x, q=torchs: quantized_linear(x, q, None), 0, 0.1))
    return cases


def _gemm_cases(ops, batch: int, against: str) -> list[KernelCase]:
    """Our bf16 GEMM (GEMM path own-bf16) against oneDNN's reordered weight (path onednn;
    F.linear where this torch or CPU has no oneDNN bf16) or inductor's compiled GEMM, SmolLM2's
    weight shapes at the batch's rows."""
    import torch
    from inductor_gemm import compile_linear

    from parashift.layers.gemm import Gemm, gemm_for_path
    from parashift.layers.gemm_paths import can_reorder

    cases, kernel = [], GEMM_KERNELS[ops.bf16_gemm]
    for name, (n, k) in GEMM_SHAPES.items():
        weight = (torch.randn(n, k) * 0.05).bfloat16()
        x = torch.randn(batch, k).bfloat16()
        packed = ops.pack_bf16(weight)
        if against == "inductor":
            reference, seconds = compile_linear(weight, x)
            typer.echo(f"  (inductor compiled the {name} GEMM in {seconds:.1f} s)")
        else:
            gemm = Gemm(weight)
            # oneDNN's bf16 needs AVX-512BW/VL/DQ or AVX-NE-CONVERT (not a Zen 3's)
            with contextlib.suppress(RuntimeError):
                gemm = gemm_for_path(weight, "onednn") if can_reorder() else gemm

            def reference(x=x, gemm=gemm):  # the GEMM path onednn, or F.linear
                return gemm(x, None)
        cases.append(KernelCase(f"{name} GEMM ({kernel})", f"{batch} x {k} -> {n}",
                                lambda x=x, p=packed, n=n: ops.gemm_bf16(x, p, n, None),
                                reference, 0, 0.1))
    return cases


def cpu_kernels(
    batch: Annotated[int, typer.Option(help="decode sequences")] = 32,
    context: Annotated[int, typer.Option(help="decode context length")] = 256,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16")] = "bfloat16",
    reps: Annotated[int, typer.Option(help="timed calls per kernel; the median is kept")] = 30,
    gemm_against: Annotated[str, typer.Option(
        help="what our GEMM is timed against: onednn (its reordered weight) or inductor "
             "(torch.compile max-autotune, the weight frozen: its C++ GEMM template)")
    ] = "onednn",
    save_json: SaveJson = None,
) -> None:
    """Each compiled CPU kernel against the torch ops it replaces, on this CPU."""
    setup_logging()
    import torch

    from parashift.layers.kernel_dispatch import cpu_ops

    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype!r}: the CPU kernels run float32 and bfloat16")
    if gemm_against not in ("onednn", "inductor"):
        fail(f"--gemm-against {gemm_against!r}: choose onednn or inductor")
    if cpu_ops() is None:
        fail("the CPU kernels could not be built here "
             "(see the warning above)")
    flush = torch.zeros(64 << 20, dtype=torch.uint8)  # past any cache of these machines
    rows = []
    typer.echo(f"{torch.get_num_threads()} threads, {dtype}, caches flushed before each call")
    typer.echo(f"{'kernel':<30}{'shape':<42}{'max err':>9}{'us':>9}{'torch us':>10}{'x':>7}")
    for case in cases(batch, context, getattr(torch, dtype), gemm_against):
        want, got = case.reference(), case.run()  # reference first: rotary works in place
        err = float((got.float() - want.float()).abs().max())
        seconds = statistics.median(time_cold(case.run, reps, flush))
        torch_seconds = statistics.median(time_cold(case.reference, reps, flush))
        ok = err <= case.tolerance
        rows.append({"kernel": case.name, "shape": case.shape, "max_error": err, "ok": ok,
                     "seconds": seconds, "torch_seconds": torch_seconds})
        typer.echo(f"{case.name:<30}{case.shape:<42}{err:>9.1e}{seconds * 1e6:>9.1f}"
                   f"{torch_seconds * 1e6:>10.1f}{torch_seconds / seconds:>7.2f}"
                   f"{'' if ok else '  FAIL'}")
    if save_json:
        from parashift.bench.report import save_json as write

        write(save_json, "bench cpu-kernels", {"batch": batch, "context": context,
                                               "dtype": dtype, "reps": reps,
                                               "gemm_against": gemm_against}, {"kernels": rows})
    if not all(r["ok"] for r in rows):
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(cpu_kernels)

"""`python scripts/bench_kernels.py --sweep`: the paged attention kernels timed over their launch
configurations (cache blocks per key tile, warps, pipeline stages; query rows per program for
prefill) at several serving shapes, each configuration checked against the torch reference.
It is how the defaults in `kernels/decode_attention.py` and `kernels/prefill_attention.py`
are chosen on a GPU: one table per shape, the current default first, then the fastest.

Every timed call reads a different set of cache blocks (rotated), so that a shape whose K/V
fits in L2 is not timed from L2."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import typer

L2_FLUSH_BYTES = 256 << 20  # several times an H100/H200's 50-60 MB of L2
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


@dataclass
class SweepRow:
    kernel: str
    shape: str
    launch: dict
    seconds: float
    max_error: float
    default: bool


def time_cuda(fn: Callable[[], Any], reps: int) -> list[float]:
    """Seconds per call, CUDA events around each of `reps` calls after 3 warm-ups."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def _rotations(bytes_per_call: int) -> int:
    return max(1, min(16, -(-L2_FLUSH_BYTES // bytes_per_call)))


def _caches(blocks: int):
    import torch

    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return (torch.randn(shape, dtype=torch.bfloat16, device="cuda"),
            torch.randn(shape, dtype=torch.bfloat16, device="cuda"))


def _tables(count: int, rows: int, blocks_per_row: int, num_blocks: int):
    import torch

    ids = torch.randperm(num_blocks, device="cuda")
    per = rows * blocks_per_row
    return [ids[i * per:(i + 1) * per].view(rows, blocks_per_row).int() for i in range(count)]


def _time_rotating(calls: list, reps: int) -> float:
    state = {"i": 0}

    def one():
        calls[state["i"] % len(calls)]()
        state["i"] += 1

    return statistics.median(time_cuda(one, reps))


def _time_launches(kernel: str, shape: str, default, launches: list, run, tables: list,
                   want, reps: int) -> list[SweepRow]:
    """run(table, launch) -> the kernel's output; the default launch first, then the rest."""
    rows = []
    for launch in [default] + [x for x in launches if x != default]:
        calls = [partial(run, table, launch) for table in tables]
        err = float((calls[0]().float() - want).abs().max())
        rows.append(SweepRow(kernel, shape, asdict(launch), _time_rotating(calls, reps), err,
                             launch == default))
    return rows


def sweep_decode(batch: int, context: int, reps: int) -> list[SweepRow]:
    import torch
    from parashift.kernels import decode_attention as da

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blocks_per_seq = -(-context // BLOCK)
    count = _rotations(2 * batch * context * KV_HEADS * HEAD_DIM * 2)
    key_cache, value_cache = _caches(count * batch * blocks_per_seq)
    tables = _tables(count, batch, blocks_per_seq, key_cache.shape[0])
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    splits = da.num_splits_for(batch, KV_HEADS, context, BLOCK, sms)
    want = da.paged_decode_attention_reference(q, key_cache, value_cache, tables[0], lens,
                                               HEAD_DIM**-0.5).float()

    def run(table, launch):
        return da.paged_decode_attention(q, key_cache, value_cache, table, lens, HEAD_DIM**-0.5,
                                         splits, launch=launch)

    launches = [da.Launch(t, w, s) for t, w, s in itertools.product((1, 2, 4, 8), (4, 8), (2, 3))]
    return _time_launches("paged decode attention",
                          f"batch {batch}, context {context}, {splits} splits",
                          da.decode_launch(blocks_per_seq, splits), launches, run, tables, want,
                          reps)


def sweep_prefill(num_seqs: int, cached: int, new: int, reps: int) -> list[SweepRow]:
    import torch
    from parashift.kernels import prefill_attention as pa

    blocks_per_seq = -(-(cached + new) // BLOCK)
    count = _rotations(2 * num_seqs * (cached + new) * KV_HEADS * HEAD_DIM * 2)
    key_cache, value_cache = _caches(count * num_seqs * blocks_per_seq)
    tables = _tables(count, num_seqs, blocks_per_seq, key_cache.shape[0])
    q = torch.randn(num_seqs * new, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    starts = torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32, device="cuda")
    lens = torch.full((num_seqs,), cached + new, dtype=torch.int32, device="cuda")
    want = pa.paged_prefill_attention_reference(q, key_cache, value_cache, tables[0], starts,
                                                lens, HEAD_DIM**-0.5).float()

    def run(table, launch):
        return pa.paged_prefill_attention(q, key_cache, value_cache, table, starts, lens, new,
                                          HEAD_DIM**-0.5, launch=launch)

    launches = [pa.PrefillLaunch(t, w, s, m) for t, w, s, m in
                itertools.product((1, 2, 4), (4, 8), (2, 3), (64, 128))]
    return _time_launches("varlen prefill attention", f"{num_seqs} x ({cached} cached + {new} new)",
                          pa.PREFILL_LAUNCH, launches, run, tables, want, reps)


def run_sweep(reps: int, tolerance: float = 2e-2) -> dict[str, Any]:
    rows = []
    for shape_rows in itertools.chain(
            (sweep_decode(*shape, reps) for shape in ((64, 2048), (128, 1024), (16, 8192),
                                                      (1, 4096))),
            (sweep_prefill(*shape, reps) for shape in ((4, 512, 512), (1, 0, 2048)))):
        rows += shape_rows
        default = next(r for r in shape_rows if r.default)
        ranked = sorted((r for r in shape_rows if r.max_error <= tolerance),
                        key=lambda r: r.seconds)
        bad = sum(r.max_error > tolerance for r in shape_rows)
        typer.echo(f"{default.kernel}, {default.shape}: default {_launch(default.launch)} "
                   f"{default.seconds * 1e6:.1f} us; {bad} configurations over tolerance")
        for r in ranked[:3]:
            typer.echo(f"    {_launch(r.launch):<52}{r.seconds * 1e6:>9.1f} us "
                       f"{default.seconds / r.seconds:>6.2f}x  err {r.max_error:.1e}")
    return {"rows": [asdict(r) for r in rows]}


def _launch(launch: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in launch.items())

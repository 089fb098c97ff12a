"""`parashift bench kernels --sweep`: the paged attention kernels timed over their launch
configurations (cache blocks per key tile, warps, pipeline stages; query rows per program for
prefill) at several serving shapes, each configuration checked against the torch reference.
It is how the defaults in `kernels/decode_attention.py` and `kernels/prefill_attention.py`
are chosen on a GPU: one table per shape, the current default first, then the fastest.

Every timed call reads a different set of cache blocks (rotated), so that a shape whose K/V
fits in L2 is not timed from L2."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import typer

from parashift.bench.kernels import time_cuda

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


def sweep_decode(shapes: list[tuple[int, int]], reps: int) -> list[SweepRow]:
    import torch

    from parashift.kernels import decode_attention as da

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    launches = [da.Launch(t, w, s) for t, w, s in itertools.product((1, 2, 4, 8), (4, 8), (2, 3))]
    rows = []
    for batch, context in shapes:
        blocks_per_seq = -(-context // BLOCK)
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
        count = _rotations(kv_bytes)
        key_cache, value_cache = _caches(count * batch * blocks_per_seq)
        tables = _tables(count, batch, blocks_per_seq, key_cache.shape[0])
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        splits = da.num_splits_for(batch, KV_HEADS, context, BLOCK, sms)
        want = da.paged_decode_attention_reference(q, key_cache, value_cache, tables[0], lens,
                                                   HEAD_DIM**-0.5).float()
        shape = f"batch {batch}, context {context}, {splits} splits"
        default = da.decode_launch(blocks_per_seq, splits)
        for launch in [default] + [x for x in launches if x != default]:
            calls = [partial(da.paged_decode_attention, q, key_cache, value_cache, t, lens,
                             HEAD_DIM**-0.5, splits, launch=launch) for t in tables]
            err = float((calls[0]().float() - want).abs().max())
            rows.append(SweepRow("paged decode attention", shape, asdict(launch),
                                 _time_rotating(calls, reps), err, launch == default))
    return rows


def sweep_prefill(shapes: list[tuple[int, int, int]], reps: int) -> list[SweepRow]:
    import torch

    from parashift.kernels import prefill_attention as pa

    launches = [pa.PrefillLaunch(t, w, s, m) for t, w, s, m in
                itertools.product((1, 2, 4), (4, 8), (2, 3), (64, 128))]
    rows = []
    for num_seqs, cached, new in shapes:
        blocks_per_seq = -(-(cached + new) // BLOCK)
        count = _rotations(2 * num_seqs * (cached + new) * KV_HEADS * HEAD_DIM * 2)
        key_cache, value_cache = _caches(count * num_seqs * blocks_per_seq)
        tables = _tables(count, num_seqs, blocks_per_seq, key_cache.shape[0])
        q = torch.randn(num_seqs * new, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        starts = torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32, device="cuda")
        lens = torch.full((num_seqs,), cached + new, dtype=torch.int32, device="cuda")
        want = pa.paged_prefill_attention_reference(q, key_cache, value_cache, tables[0],
                                                    starts, lens, HEAD_DIM**-0.5).float()
        shape = f"{num_seqs} x ({cached} cached + {new} new)"
        for launch in [pa.PREFILL_LAUNCH] + [x for x in launches if x != pa.PREFILL_LAUNCH]:
            calls = [partial(pa.paged_prefill_attention, q, key_cache, value_cache, t, starts,
                             lens, new, HEAD_DIM**-0.5, launch=launch) for t in tables]
            err = float((calls[0]().float() - want).abs().max())
            rows.append(SweepRow("varlen prefill attention", shape, asdict(launch),
                                 _time_rotating(calls, reps), err, launch == pa.PREFILL_LAUNCH))
    return rows


def run_sweep(reps: int, tolerance: float = 2e-2) -> dict[str, Any]:
    rows = []
    for shape_rows in itertools.chain(
            (sweep_decode([shape], reps) for shape in ((64, 2048), (128, 1024), (16, 8192),
                                                       (1, 4096))),
            (sweep_prefill([shape], reps) for shape in ((4, 512, 512), (1, 0, 2048)))):
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

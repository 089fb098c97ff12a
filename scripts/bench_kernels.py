"""`python scripts/bench_kernels.py`: every Triton kernel of `parashift.kernels` on the GPU, checked
against its torch reference at a serving-sized shape and timed against the memory-bandwidth
floor (the bytes it must move, over the device-to-device copy bandwidth measured in the same
run). bf16 on the GPU (its bf16 tl.dot is right; only the interpreter's is not)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from kernel_sweep import time_cuda

from parashift.bench.options import SaveJson
from parashift.cli_options import fail, setup_logging


@dataclass
class KernelCase:
    name: str
    shape: str
    run: Callable[[], Any]
    reference: Callable[[], Any]
    bytes_moved: int  # what the kernel must read and write at least
    tolerance: float
    flops: int = 0  # the arithmetic it must do at least (0: a memory-bound kernel)
    timed: Callable[[], Any] | None = None  # what is timed, where `run` adds a copy to check


def copy_bandwidth(reps: int) -> float:
    """Bytes per second of a 2 GiB device-to-device copy, read and write both counted."""
    import torch

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / statistics.median(time_cuda(lambda: dst.copy_(src), reps))


def matmul_rate(reps: int) -> float:
    """FLOP/s of an 8192 x 8192 x 8192 bf16 matrix product on random data."""
    import torch

    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    return 2 * 8192**3 / statistics.median(time_cuda(lambda: a @ b, reps))


def cases(batch: int, context: int) -> list[KernelCase]:
    import torch
    from parashift.kernels import decode_attention as da
    from parashift.kernels import fused_moe as fm
    from parashift.kernels import kv_cache_write as kw
    from parashift.kernels import prefill_attention as pa
    from parashift.kernels import rms_norm as rn
    from parashift.kernels import rotary as ro

    dev, dt = "cuda", torch.bfloat16
    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    blocks_per_seq = -(-context // block)
    num_seqs, new, cached = 4, 512, 512  # the prefill case below
    prefill_blocks = -(-(new + cached) // block)
    shape = (max(batch * blocks_per_seq, num_seqs * prefill_blocks) + 1, block, kv_heads,
             head_dim)
    key_cache, value_cache = torch.randn(shape, dtype=dt, device=dev), torch.randn(
        shape, dtype=dt, device=dev)
    table = torch.randperm(shape[0] - 1, device=dev)[: batch * blocks_per_seq].view(
        batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, head_dim, dtype=dt, device=dev)
    splits = da.num_splits_for(batch, kv_heads, context, block,
                               torch.cuda.get_device_properties(0).multi_processor_count)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    out = [KernelCase(
        "paged decode attention", f"batch {batch}, context {context}, {heads}/{kv_heads} heads "
        f"x {head_dim}, {splits} splits",
        lambda: da.paged_decode_attention(q, key_cache, value_cache, table, lens,
                                          head_dim**-0.5, splits),
        lambda: da.paged_decode_attention_reference(q, key_cache, value_cache, table, lens,
                                                    head_dim**-0.5),
        kv_bytes + 2 * q.numel() * 2, 2e-2)]
    # prefill: 4 sequences of 512 new tokens after a 512-token cached prefix
    ptable = torch.randperm(shape[0] - 1, device=dev)[: num_seqs * prefill_blocks].view(
        num_seqs, prefill_blocks).int()
    pq = torch.randn(num_seqs * new, heads, head_dim, dtype=dt, device=dev)
    starts = torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32, device=dev)
    plens = torch.full((num_seqs,), new + cached, dtype=torch.int32, device=dev)
    out.append(KernelCase(
        "varlen prefill attention", f"{num_seqs} x ({cached} cached + {new} new)",
        lambda: pa.paged_prefill_attention(pq, key_cache, value_cache, ptable, starts, plens,
                                           new, head_dim**-0.5),
        lambda: pa.paged_prefill_attention_reference(pq, key_cache, value_cache, ptable,
                                                     starts, plens, head_dim**-0.5),
        2 * pq.numel() * 2 + 2 * num_seqs * (new + cached) * kv_heads * head_dim * 2, 2e-2,
        # q.k and p.v for every (query, key) pair the causal mask lets through
        flops=4 * heads * head_dim * num_seqs * sum(cached + i + 1 for i in range(new))))
    tokens = 8192
    k_new = torch.randn(tokens, kv_heads, head_dim, dtype=dt, device=dev)
    v_new = torch.randn(tokens, kv_heads, head_dim, dtype=dt, device=dev)
    slots = torch.randperm(shape[0] * block, device=dev)[:tokens]
    kc, vc = key_cache.clone(), value_cache.clone()
    out.append(KernelCase(
        "KV-cache write", f"{tokens} tokens x {kv_heads} x {head_dim}",
        lambda: kw.write_kv_cache(k_new, v_new, key_cache, value_cache, slots)
        or torch.stack([key_cache, value_cache]),
        lambda: kw.write_kv_cache_reference(k_new, v_new, kc, vc, slots)
        or torch.stack([kc, vc]),
        4 * k_new.numel() * 2, 0.0,
        timed=lambda: kw.write_kv_cache(k_new, v_new, key_cache, value_cache, slots)))
    hidden = 4096
    x, res = torch.randn(tokens, hidden, dtype=dt, device=dev), torch.randn(
        tokens, hidden, dtype=dt, device=dev)
    w = torch.randn(hidden, dtype=dt, device=dev)
    out.append(KernelCase(
        "RMSNorm + residual", f"{tokens} x {hidden}",
        lambda: rn.rms_norm(x, w, 1e-6, res)[0],
        lambda: rn.rms_norm_reference(x, w, 1e-6, res)[0], 4 * x.numel() * 2, 5e-2))
    rq = torch.randn(tokens, heads + kv_heads, head_dim, dtype=dt, device=dev)
    before = rq.clone()  # in place: the check is the first call's, from these values
    angles = torch.rand(4096, head_dim // 2, device=dev) * 6.3
    cos, sin = angles.cos(), angles.sin()
    pos = torch.randint(0, 4096, (tokens,), device=dev)
    out.append(KernelCase(
        "rotary (neox)", f"{tokens} tokens x {heads + kv_heads} heads x {head_dim}",
        lambda: ro.apply_rotary(rq[:, :heads], rq[:, heads:], cos, sin, pos) or rq,
        lambda: torch.cat(ro.apply_rotary_reference(before[:, :heads], before[:, heads:],
                                                    cos, sin, pos), dim=1),
        2 * rq.numel() * 2, 3e-2))
    experts, h, inter, moe_tokens = 8, 4096, 14336, 256
    mx = torch.randn(moe_tokens, h, dtype=dt, device=dev)
    w13 = torch.randn(experts, 2 * inter, h, dtype=dt, device=dev) / h**0.5
    w2 = torch.randn(experts, h, inter, dtype=dt, device=dev) / inter**0.5
    tw, ti = torch.randn(moe_tokens, experts, device=dev).softmax(-1).topk(2, dim=-1)
    out.append(KernelCase(
        "fused MoE (align + 2 grouped GEMMs)", f"{moe_tokens} tokens, {experts} experts "
        f"{h}x{inter}, top-2",
        lambda: fm.fused_moe(mx, w13, w2, tw, ti),
        lambda: fm.fused_moe_reference(mx, w13, w2, tw, ti),
        (w13.numel() + w2.numel()) * 2, 5e-2,
        flops=2 * moe_tokens * 2 * (w13[0].numel() + w2[0].numel())))
    return out


def kernels(
    batch: Annotated[int, typer.Option(help="decode sequences")] = 64,
    context: Annotated[int, typer.Option(help="decode context length")] = 2048,
    reps: Annotated[int, typer.Option(help="timed calls per kernel; the median is kept")] = 20,
    sweep: Annotated[bool, typer.Option(
        help="also time the attention kernels over their launch configurations")] = False,
    save_json: SaveJson = None,
) -> None:
    """Each Triton kernel against its reference on the GPU, timed against its floor: the
    bytes it must move over the copy bandwidth, or its FLOPs over the bf16 matrix rate,
    whichever is longer (both measured in the same run)."""
    setup_logging()
    import torch

    if not torch.cuda.is_available():
        fail("scripts/bench_kernels.py needs a CUDA GPU: on CPU the kernels run only under "
             "Triton's interpreter, which times nothing real (tests/kernel_tests checks them "
             "there)")
    bandwidth, rate = copy_bandwidth(reps), matmul_rate(reps)
    rows = []
    typer.echo(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, "
               f"bf16 matrix product {rate / 1e12:.0f} TFLOP/s")
    typer.echo(f"{'kernel':<38}{'shape':<52}{'max err':>9}{'us':>9}{'floor us':>10}"
               f"{'% floor':>9}  bound")
    for case in cases(batch, context):
        got, want = case.run(), case.reference()
        err = float((got.float() - want.float()).abs().max())
        seconds = statistics.median(time_cuda(case.timed or case.run, reps))
        floor = max(case.bytes_moved / bandwidth, case.flops / rate)
        bound = "compute" if case.flops / rate > case.bytes_moved / bandwidth else "memory"
        ok = err <= case.tolerance
        rows.append({"kernel": case.name, "shape": case.shape, "max_error": err, "ok": ok,
                     "seconds": seconds, "floor_seconds": floor, "bound": bound,
                     "fraction_of_floor": floor / seconds})
        typer.echo(f"{case.name:<38}{case.shape:<52}{err:>9.1e}{seconds * 1e6:>9.1f}"
                   f"{floor * 1e6:>10.1f}{100 * floor / seconds:>8.0f}%  {bound}"
                   f"{'' if ok else '  FAIL'}")
    swept = None
    if sweep:
        from kernel_sweep import run_sweep

        swept = run_sweep(reps)
    if save_json:
        from parashift.bench.report import save_json as write

        write(save_json, "bench kernels", {"batch": batch, "context": context, "reps": reps},
              {"copy_bandwidth": bandwidth, "matmul_rate": rate, "kernels": rows,
               "sweep": swept})
    if not all(r["ok"] for r in rows):
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(kernels)

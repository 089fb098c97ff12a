"""`parashift bench latency --breakdown`: where a decode step's time goes, on this machine.

One batch runs through the engine twice, step by step: once plain (the step times), once
under torch.profiler. In the profile every op of a decode step is put in one bucket:
attention (everything inside the attention layers: KV write, gather, SDPA), sampling
(everything inside the sampler), GEMM (the matrix-multiply kernels elsewhere: linears and the
LM head), other ops (norms, rotary, activations, embedding, copies: torch's or the compiled
CPU kernels'); what the step's
wall time holds beyond its ops is Python and bookkeeping (scheduler, input preparation, op
dispatch). The plain run also times, per step, what the model runner spends in the forward,
the logits and the sampler (the kernels' work: on CPU the GEMM and attention kernels): the rest
of the step's wall time is the host's serial time (scheduling, input preparation, output
processing), the share async scheduling and the persistent batch take off the critical path.
Beside it, the GEMM floor of the same run: every GEMM weight of the model once, at
the batch's rows, back to back (weights streamed from memory as in a real step). Under the
profiler the decoder layers run op by op even where they are one kernel call otherwise
(executor/fused_cpu_layers.py): the plain step time is the fused one, the split the unfused."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

GEMM_OPS = {"mkl::_mkl_linear", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm",
            "aten::bmm", "aten::baddbmm", "aten::_weight_int8pack_mm",
            "aten::_weight_int4pack_mm_for_cpu", "parashift_cpu::gemm_bf16"}
BUCKETS = ("gemm", "attention", "sampling", "grammar", "other_ops", "python")


def _run_batch(core, prompts: list[list[int]], output_len: int, label: bool,
               sampling: dict | None, device: list[float] | None = None
               ) -> list[tuple[float, float]]:
    """Every step of one batch: its seconds, and those of `device` (a _device_timer's) within
    it (the first step is the prefill)."""
    from torch.profiler import record_function

    from parashift.engine.request import Request
    from parashift.types.sampling_params import SamplingParams

    core.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, ignore_eos=True,
                            **(sampling or {"temperature": 0.0}))
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"b{i}", prompt, params, None))
    times = []
    while core.has_unfinished_requests():
        if device is not None:
            device[0] = 0.0
        start = time.perf_counter()
        if label:
            with record_function(f"parashift::step:{len(times)}"):
                core.step()
        else:
            core.step()
        times.append((time.perf_counter() - start, device[0] if device is not None else 0.0))
    return times


@contextlib.contextmanager
def _device_timer(runner) -> Iterator[list[float]]:
    """Seconds the runner spends in the forward (a CUDA graph's too), the logits and the
    sampler, summed since the last read (the list's one entry); the runner's own methods are
    restored after. With async scheduling a runner call that spans two steps counts in the
    step it ends in."""
    spent = [0.0]

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    targets = [(runner, "_forward_stage"), (runner.sampler, "sample"),
               (runner.model, "compute_logits")]
    if runner.graphs is not None:
        targets.append((runner.graphs, "run"))
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name in targets]
    for owner, name in targets:
        setattr(owner, name, timed(getattr(owner, name)))
    try:
        yield spent
    finally:  # each instance's own attribute again, or none (its class's method)
        for owner, name, own in saved:
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def _bucket(event) -> tuple[int | None, str]:
    """(step index or None, bucket) of one profiled event, from its enclosing labels."""
    step, bucket = None, None
    node = event
    while node is not None:
        name = node.name
        if name.startswith("parashift::step:"):
            step = int(name.rsplit(":", 1)[1])
        elif name == "parashift::attention" and bucket is None:
            bucket = "attention"
        elif name == "parashift::sample" and bucket is None:
            bucket = "sampling"
        elif name == "parashift::grammar" and bucket is None:  # structured outputs' mask
            bucket = "grammar"
        node = node.cpu_parent
    if bucket is None:
        if event.name.startswith("parashift::step:"):
            bucket = "python"  # the step's own time outside every op
        else:
            bucket = "gemm" if event.name in GEMM_OPS else "other_ops"
    return step, bucket


def gemm_floor_ms(model, rows: int, repeat: int = 5) -> float:
    """Every GEMM weight of `model` once at `rows` rows, back to back (best of `repeat`). The
    weights stream from memory as in a step; the input of each width is one tensor, in cache as
    the op before a GEMM leaves it (121 cold inputs made the floor 1.3x the step's own GEMMs)."""
    import torch

    from parashift.layers.gemm import Gemm

    gemms = [m for m in model.modules() if isinstance(getattr(m, "gemm", None), Gemm)]
    # a prepared or quantized GEMM's module weight is a meta tensor: its shape and dtype
    device = next(p.device for p in model.parameters() if not p.is_meta)
    best = float("inf")
    with torch.inference_mode():
        shared = {}
        inputs = [shared.setdefault((m.weight.shape[1], m.weight.dtype),
                                    torch.ones(rows, m.weight.shape[1], dtype=m.weight.dtype,
                                               device=device))
                  for m in gemms]
        on_gpu = device.type == "cuda"
        for _ in range(repeat):
            start = time.perf_counter()
            for m, x in zip(gemms, inputs, strict=True):
                m.gemm(x, getattr(m, "bias", None))
            if on_gpu:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def decode_breakdown(llm, batch_size: int, input_len: int, output_len: int,
                     sampling: dict | None = None) -> dict[str, Any]:
    """Median ms per decode step of a `batch_size` batch (greedy, or `sampling`'s fields):
    plain, profiled, and per bucket."""
    from torch.profiler import ProfilerActivity, profile

    core = llm.engine
    worker = getattr(core.executor, "worker", None)
    if worker is None:
        raise ValueError("--breakdown profiles one process: drop the tp and pp axes")
    vocab = llm.config.model.vocab_size
    prompts = [[(100 + 31 * b + 7 * i) % max(1, vocab - 100) for i in range(input_len)]
               for b in range(batch_size)]
    _run_batch(core, prompts, min(output_len, 4), False, sampling)  # warm-up
    with _device_timer(worker.runner) as spent:
        plain_all = _run_batch(core, prompts, output_len, False, sampling, spent)
    plain = [t for t, _ in plain_all[1:]]
    host = [t - device for t, device in plain_all[1:]]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = [t for t, _ in _run_batch(core, prompts, output_len, True, sampling)]
    per_step: dict[int, dict[str, float]] = {}
    for event in prof.events():
        step, bucket = _bucket(event)
        if step is None or step == 0:  # outside the steps, or the prefill
            continue
        buckets = per_step.setdefault(step, dict.fromkeys(BUCKETS, 0.0))
        buckets[bucket] += event.self_cpu_time_total / 1e3
    median = {b: statistics.median(s[b] for s in per_step.values()) for b in BUCKETS}
    return {"batch_size": batch_size, "decode_steps": len(plain),
            "step_ms": statistics.median(plain) * 1e3,
            "host_serial_ms": statistics.median(host) * 1e3,
            "async_scheduling": core.async_scheduling,
            "profiled_step_ms": statistics.median(profiled[1:]) * 1e3,
            "buckets_ms": median,
            "gemm_floor_ms": gemm_floor_ms(worker.model, batch_size)}


def format_breakdown(result: dict[str, Any]) -> str:
    buckets = result["buckets_ms"]
    total = sum(buckets.values())
    lines = [f"decode step at batch {result['batch_size']}: {result['step_ms']:.1f} ms "
             f"(median of {result['decode_steps']}; {result['profiled_step_ms']:.1f} ms under "
             "the profiler, layer by layer, split as:)"]
    for name in BUCKETS:
        lines.append(f"  {name.replace('_', ' '):12s} {buckets[name]:8.2f} ms  "
                     f"{buckets[name] / total:6.1%}")
    lines.append(f"  host serial time per step (the wall time outside the forward, logits "
                 f"and sampler; async scheduling "
                 f"{'on' if result['async_scheduling'] else 'off'}): "
                 f"{result['host_serial_ms']:.2f} ms")
    lines.append(f"  GEMM floor of this run (every GEMM weight once at {result['batch_size']} "
                 f"rows): {result['gemm_floor_ms']:.2f} ms")
    return "\n".join(lines)

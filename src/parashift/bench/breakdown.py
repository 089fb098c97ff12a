"""`parashift bench latency --breakdown`: where a decode step's time goes, on this machine.

One batch runs through the engine twice, step by step. Under torch.profiler every op of a
decode step goes in one bucket: attention (inside the attention layers: KV write, gather,
SDPA), sampling (inside the sampler), grammar (the structured outputs' mask), GEMM (the
matrix-multiply kernels elsewhere: linears, LM head), other ops (norms, rotary, activations,
embedding, copies); the step's wall time beyond its ops is Python and bookkeeping. The plain
run gives the step times, and the runner's own timer (ModelRunner.device_timer) what its
forward, logits and sampler took: the rest of a step is the host's serial time (scheduling,
input preparation, output processing), what async scheduling takes off the critical path.
Beside it, the GEMM floor: every GEMM weight once at the batch's rows, back to back. Under the
profiler the decoder layers run op by op even where they are one kernel call otherwise
(executor/fused_cpu_layers.py): the plain step time is the fused one, the split the unfused."""

from __future__ import annotations

import statistics
import time
from typing import Any

from parashift.layers.profiling import DeviceTimer, profiler_label

GEMM_OPS = {"mkl::_mkl_linear", "mkldnn::_linear_pointwise", "aten::mm", "aten::addmm",
            "aten::bmm", "aten::baddbmm", "aten::_weight_int8pack_mm",
            "aten::_weight_int4pack_mm_for_cpu", "parashift_cpu::gemm_bf16"}
BUCKETS = ("gemm", "attention", "sampling", "grammar", "other_ops", "python")


def _run_batch(core, prompts: list[list[int]], output_len: int, sampling: dict | None,
               timer: DeviceTimer | None = None) -> list[tuple[float, float]]:
    """Every step of one batch (labelled for the profiler when it runs): its seconds, and
    those `timer` (the runner's) counted within it (the first step is the prefill)."""
    from parashift.bench.offline import sampling_params
    from parashift.engine.request import Request

    core.reset_prefix_cache()
    params = sampling_params(output_len, sampling)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(f"b{i}", prompt, params, None))
    times = []
    while core.has_unfinished_requests():
        if timer is not None:
            timer.take()  # what ran between the steps is neither's
        start = time.perf_counter()
        with profiler_label(f"parashift::step:{len(times)}"):
            core.step()
        times.append((time.perf_counter() - start, timer.take() if timer is not None else 0.0))
    return times


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

    from parashift.bench.offline import latency_prompts

    core = llm.engine
    worker = getattr(core.executor, "worker", None)
    if worker is None:
        raise ValueError("--breakdown profiles one process: drop the tp and pp axes")
    prompts = latency_prompts(llm.config.model.vocab_size, batch_size, input_len)
    _run_batch(core, prompts, min(output_len, 4), sampling)  # warm-up
    runner = worker.runner
    runner.device_timer = DeviceTimer()  # the runner times its forward, logits and sampler
    try:
        plain_all = _run_batch(core, prompts, output_len, sampling, runner.device_timer)
    finally:
        runner.device_timer = None
    plain = [t for t, _ in plain_all[1:]]
    host = [t - device for t, device in plain_all[1:]]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = [t for t, _ in _run_batch(core, prompts, output_len, sampling)]
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

"""What bounds data-parallel scaling on a CPU, measured offline with one thread: the decode
step time at several batch sizes, and the GEMMs' weight-streaming floor (every GEMM of the
model at one row: each weight read once, almost no arithmetic). A step is modelled as
step(B) = fixed + per_seq x B."""

from __future__ import annotations

import time
from typing import Any

TARGET_EFFICIENCY = 0.85


def step_costs(model: str | None, dtype: str, batches: tuple[int, ...], steps: int = 32,
               rounds: int = 2) -> dict[str, Any]:
    """Decode ms per step at each of `batches` sequences (best of `rounds`, interleaved) and
    the GEMM floor in ms, one thread."""
    import torch

    from parashift import LLM, SamplingParams
    from parashift.layers.gemm import Gemm

    torch.set_num_threads(1)
    llm = LLM(model, dtype=dtype, num_threads=1)
    try:
        vocab = llm.config.model.vocab_size
        llm.generate([[100 % vocab] * 16], SamplingParams(max_tokens=2), use_tqdm=False)
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        step: dict[int, float] = {}
        for _ in range(rounds):
            for batch in batches:
                prompts = [[(100 + i + j) % vocab for j in range(16)] for i in range(batch)]
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                ms = (time.perf_counter() - start) / steps * 1e3
                step[batch] = min(ms, step.get(batch, ms))
        gemms = [m for m in llm.engine.executor.worker.model.modules()
                 if isinstance(getattr(m, "gemm", None), Gemm)]
        weight_bytes = sum(m.gemm.read_bytes for m in gemms)
        floor = float("inf")
        with torch.inference_mode():
            for _ in range(5):
                start = time.perf_counter()
                for m in gemms:
                    x = torch.ones(1, m.weight.shape[1], dtype=m.weight.dtype)
                    m.gemm(x, getattr(m, "bias", None))
                floor = min(floor, (time.perf_counter() - start) * 1e3)
    finally:
        llm.shutdown()
    return {"step_ms": step, "gemm_floor_ms": floor, "gemm_weight_bytes": weight_bytes}


def efficiency_model(costs: dict[str, Any], dp: int, part: int, whole: int) -> dict[str, Any]:
    """dp ranks each run a step of `part` sequences in the time one engine runs a step of
    `whole`, so the efficiency is step(whole) / (dp x step(part)) = (F + wc) / (dp F + wc). The
    fixed part F is at least the GEMM floor; with nothing else fixed, the ceiling is reached."""
    step = costs["step_ms"]
    per_seq = (step[whole] - step[part]) / (whole - part)
    fixed = step[part] - per_seq * part
    floor = costs["gemm_floor_ms"]
    need = TARGET_EFFICIENCY * dp - 1  # (F + wc) / (dp F + wc) >= target, solved for c
    return {"fixed_ms": fixed, "per_seq_ms": per_seq, "bound": step[whole] / (dp * step[part]),
            "ceiling": (floor + whole * per_seq) / (dp * floor + whole * per_seq),
            f"per_seq_ms_needed_for_{TARGET_EFFICIENCY}":
                need * floor / (whole - TARGET_EFFICIENCY * dp * part)}

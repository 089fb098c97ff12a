"""`parashift bench throughput --roofline`: the best GEMM rate reached on this device for the
model's own GEMM shapes, by any path the engine may take there (on CPU: F.linear,
oneDNN's reordered weight and our own kernel, in bf16), and a throughput as a fraction of it
(2 x parameters x tokens/s, the forward pass's multiply-adds)."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import torch

ROOFLINE_M = (256, 1024, 2048)  # rows: the tokens of a prefill chunk or a large batch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn, device: torch.device, min_time: float = 0.1, trials: int = 5) -> float:
    """Best seconds per call of `fn`."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - start, 1e-6)
    iters = max(1, int(min_time / once))
    best = float("inf")
    for _ in range(trials):
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def measure_roofline(device: torch.device, hidden_size: int, intermediate_size: int
                     ) -> dict[str, Any]:
    """GEMMs of M x K=hidden x N in {intermediate, hidden} on bf16 operands, by every path a
    bf16 weight's GEMM may take on `device` (layers/gemm_paths.py): the best rate. A ceiling
    below a path the engine takes would flatter it."""
    from parashift.layers.gemm import gemm_for_path
    from parashift.layers.gemm_paths import candidates

    paths = candidates(torch.bfloat16) if device.type == "cpu" else ["linear"]

    g = torch.Generator().manual_seed(0)
    k, rows = hidden_size, []
    for m in ROOFLINE_M:
        for n in (intermediate_size, hidden_size):
            x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
            w = torch.randn(n, k, generator=g).to(device, torch.bfloat16)
            for path in paths:
                with torch.inference_mode():
                    gemm = gemm_for_path(w, path)
                    # best of 3 x 50 ms: a GEMM of these shapes is stable, and there are many
                    seconds = time_op(partial(gemm, x, None), device,
                                      min_time=0.05, trials=3)
                rows.append({"path": path, "M": m, "K": k, "N": n, "seconds": seconds,
                             "gflops": 2.0 * m * n * k / seconds / 1e9})
    best = max(rows, key=lambda r: r["gflops"])
    return {"shapes": rows, "best_gflops": best["gflops"],
            "best": {key: best[key] for key in ("path", "M", "K", "N")}}


def count_params(hf_config: Any) -> int:
    """The model's parameters (tied embeddings once), built on the meta device: no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def model_gflops(num_params: int, tokens_per_s: float) -> float:
    return 2.0 * num_params * tokens_per_s / 1e9

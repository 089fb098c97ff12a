"""`bench throughput --roofline`: the ceiling is the best GEMM of every path the engine may
take, so no path it runs can be faster than its own ceiling."""

from __future__ import annotations

import torch

from parashift.bench import roofline
from parashift.layers.gemm_paths import candidates


def test_the_ceiling_times_every_path_the_engine_may_take(monkeypatch):
    monkeypatch.setattr(roofline, "ROOFLINE_M", (16,))
    result = roofline.measure_roofline(torch.device("cpu"), 64, 96)
    timed = {(r["path"], r["N"]) for r in result["shapes"]}
    assert timed == {(p, n) for p in candidates(torch.bfloat16) for n in (96, 64)}
    assert all(r["M"] == 16 and r["K"] == 64 and r["seconds"] > 0 for r in result["shapes"])
    best = max(result["shapes"], key=lambda r: r["gflops"])
    assert result["best_gflops"] == best["gflops"]
    assert result["best"] == {k: best[k] for k in ("path", "M", "K", "N")}

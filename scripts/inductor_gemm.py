"""A weight's GEMM compiled by torch.compile's inductor the way its C++ GEMM template takes it:
mode max-autotune (the template is one of the candidates it times), the weight frozen into the
graph (`freezing`: the template packs only constant weights), one fixed row count (dynamic rows
would recompile). For `bench cpu-kernels --gemm-against inductor`, which weighs it against our
GEMM: the compiler's way to a packed-weight GEMM, against ours written by hand. Beware its cache:
with the kernels held to AVX2, torch 2.13's warm FX graph cache gave back a graph holding an
earlier process's weight (the check then fails; docs/BENCHMARKS.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def compile_linear(weight: Any, x: Any) -> tuple[Callable[[], Any], float]:
    """weight [n, k], x [rows, k] -> (a call of x W^T through the compiled graph, the seconds
    its compile took)."""
    import torch
    import torch._inductor.config as inductor_config

    n, k = weight.shape
    module = torch.nn.Linear(k, n, bias=False, dtype=weight.dtype)
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    compiled = torch.compile(module, mode="max-autotune", dynamic=False)

    def run():
        with torch.no_grad():  # freezing applies to inference graphs only
            return compiled(x)

    start = time.perf_counter()
    with inductor_config.patch(freezing=True):
        run()
    return run, time.perf_counter() - start

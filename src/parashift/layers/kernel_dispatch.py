"""When a layer runs its Triton kernel from `parashift.kernels`: on CUDA tensors, with Triton
installed. Elsewhere the layer's torch code runs (the kernel tests run the kernels on CPU
under Triton's interpreter, against the same torch code as reference)."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def on_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and has_triton()

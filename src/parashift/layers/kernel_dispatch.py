"""When a layer runs a kernel from `parashift.kernels` instead of its own torch code:
- Triton kernels on CUDA tensors, with Triton installed (the kernel tests run them on CPU under
  Triton's interpreter, against the same torch code as reference);
- the compiled CPU kernels (`kernels/cpu`) on float32 and bfloat16 CPU tensors, once they are
  built for this CPU (`--cpu-kernels`: off turns them off, a gcc -march builds them for
  another; a failed build falls back to the torch code with a warning)."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from parashift import env

logger = logging.getLogger(__name__)


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def on_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and has_triton()


_cpu_kernels = "native"  # this process's DeviceConfig.cpu_kernels (use_cpu_kernels)


def use_cpu_kernels(setting: str) -> None:
    """The kernels this process runs, as its config says (DeviceConfig.cpu_kernels: native,
    off, or a gcc -march); set before any layer runs."""
    global _cpu_kernels
    if setting != _cpu_kernels:
        _cpu_kernels = setting
        cpu_ops.cache_clear()


def cpu_kernels_setting() -> str:
    return _cpu_kernels


@functools.cache
def cpu_ops():
    """This CPU's compiled kernels, built on first use (a few seconds, then cached); None when
    they are turned off or cannot be built here."""
    if _cpu_kernels == "off":
        return None
    from parashift.kernels.cpu.library import load

    try:
        return load(os.path.join(env.cache_dir(), "cpu-kernels"),
                    None if _cpu_kernels == "native" else _cpu_kernels)
    except (RuntimeError, OSError) as e:
        logger.warning("CPU kernels unavailable, using torch ops instead: %s", e)
        return None


_CPU_KERNEL_DTYPES = frozenset((torch.float32, torch.bfloat16))


def on_cpu_kernels(x: torch.Tensor) -> bool:
    # Asked several times per layer and step: attribute checks only (x.device builds an object).
    return x.is_cpu and x.dtype in _CPU_KERNEL_DTYPES and cpu_ops() is not None

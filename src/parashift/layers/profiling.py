"""Labels that put ops in a bucket of `bench latency --breakdown`, only while the profiler
runs: otherwise a label costs a few microseconds each time."""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function


def profiler_label(name: str) -> contextlib.AbstractContextManager:
    return (record_function(name) if torch.autograd._profiler_enabled()
            else contextlib.nullcontext())

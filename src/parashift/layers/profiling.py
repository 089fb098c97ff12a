"""Labels that put ops in a bucket of `bench latency --breakdown`, only while the profiler
runs: otherwise a label costs a few microseconds each time."""

from __future__ import annotations

import contextlib
import time

import torch
from torch.profiler import record_function


def profiler_label(name: str) -> contextlib.AbstractContextManager:
    return (record_function(name) if torch.autograd._profiler_enabled()
            else contextlib.nullcontext())


class DeviceTimer:
    """Seconds a model runner spends in its kernels' work (the forward, a CUDA graph's too, the
    logits and the sampler), summed until read: what `bench latency --breakdown` sets on a
    runner (`ModelRunner.device_timer`) to split a step's wall time from the host's serial
    time. With async scheduling a runner call that spans two steps counts in the step it ends
    in."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def take(self) -> float:
        """The seconds since the last take, and a new count."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

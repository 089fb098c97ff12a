"""What the studies measure inside the workers, mixed into them as a worker extension
(`LLM(..., worker_extension_cls="study_probes.StudyProbes")`; the workers find this module on
the sys.path they inherit from the script). Each method answers `collective_rpc(name)`; the
product's Worker and ModelRunner carry none of it."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from parashift.distributed.communicator import CommStats
from parashift.processes import status_bytes

EXTENSION = "study_probes.StudyProbes"


@dataclass
class StageStats:
    """Where a pipeline stage's time went since the last read: running steps (its layers,
    sampling on the last stage), or, within a step, waiting on the neighbouring stages."""

    steps: int = 0
    busy_seconds: float = 0.0
    recv_seconds: float = 0.0
    send_seconds: float = 0.0  # waiting for the next stage to take the previous step's send


class StudyProbes:
    """Mixed in before Worker (worker_class): `self` is the worker."""

    def _load_model(self) -> None:
        before = _reset_peak_rss()
        super()._load_model()
        # Peak resident memory the load added (a tp shard must read only its slice), the
        # GEMM paths' preparation included.
        self.load_peak_rss = status_bytes("VmHWM") - before
        self.stage = StageStats()
        self._time_stage()

    def _time_stage(self) -> None:
        """Wrap this worker's step and its pipeline neighbour calls with clocks."""
        runner, stats = self.runner, self.stage
        execute, recv, send = runner.execute_model, runner.pp.recv_prev, runner.pp.send_next

        def timed(call: Any, field: str) -> Any:
            def wrapper(*args: Any) -> Any:
                start = time.perf_counter()
                try:
                    return call(*args)
                finally:
                    setattr(stats, field, getattr(stats, field) + time.perf_counter() - start)
            return wrapper

        def execute_model(out):
            start, waited = time.perf_counter(), stats.recv_seconds + stats.send_seconds
            result = execute(out)
            if not out.is_empty:
                stats.steps += 1
                stats.busy_seconds += (time.perf_counter() - start
                                       - (stats.recv_seconds + stats.send_seconds - waited))
            return result

        runner.execute_model = execute_model
        runner.pp.recv_prev = timed(recv, "recv_seconds")
        runner.pp.send_next = timed(send, "send_seconds")

    def load_peak_rss_bytes(self) -> int:
        return self.load_peak_rss

    def take_comm_stats(self) -> dict[str, float]:
        """The tp group's all-reduce cost since the last call (then reset)."""
        group = self.parallel.tp
        stats, group.stats = group.stats, CommStats()
        return dataclasses.asdict(stats)

    def take_stage_stats(self) -> dict[str, float]:
        """Compute and pipeline-wait seconds since the last call (then reset)."""
        taken = dataclasses.asdict(self.stage)
        for field in dataclasses.fields(self.stage):
            setattr(self.stage, field.name, field.default)
        return taken

    def time_pp_transfer(self, num_tokens: int, repeat: int) -> float | None:
        """Seconds to move one step's activations ([2, num_tokens, hidden]) from stage 0 to
        stage 1, back to back `repeat` times; the receiver answers, the others give None."""
        pp, model = self.runner.pp, self.model
        if pp.world_size == 1 or pp.rank > 1:
            return None
        shape = (2, num_tokens, model.config.hidden_size)
        if pp.rank == 0:
            for _ in range(repeat + 1):
                pp.send_next(torch.zeros(shape, dtype=model.dtype, device=self.device))
            pp.wait_sends()
            return None
        pp.recv_prev(shape, model.dtype, self.device)  # the first one absorbs the start skew
        start = time.perf_counter()
        for _ in range(repeat):
            pp.recv_prev(shape, model.dtype, self.device)
        return (time.perf_counter() - start) / repeat


def _reset_peak_rss() -> int:
    """Linux: restart the peak-RSS count (VmHWM) from now; returns the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return status_bytes("VmRSS")

"""The autoscaler (--data-parallel-size-min with --data-parallel-size-max): in the launcher,
from the coordinator's load vectors, it decides a scale the launcher then runs as one asked for
by hand (runtime/scale.py, which refuses a rank the machine's memory cannot hold).

It reads two signals, each as a time-weighted mean over its window (the launcher samples the
latest loads several times a second; a value holds until the next sample), so that a backlog
that dips between two arrivals, or a rank that idles between two of them, does not reset it:
- up, one rank at a time: the prompt tokens waiting per rank average above `up_tokens` over
  `up_window_s` (a backlog that lasts, not a burst the ranks absorb), or over `idle_window_s`
  the ranks held requests `up_busy` of the time or more (saturated: a load just under what
  the ranks can do queues little, yet every request waits behind the others);
- down, one rank at a time: over `idle_window_s` the ranks were busy (held a request) so little
  that one rank fewer would have been busy at most `down_busy` of the time, and the backlog
  averaged under a quarter of `up_tokens` (the band between is the hysteresis). A rank busy
  half the time at Poisson arrivals is idle for seconds at a stretch, so an idle stretch alone
  is no evidence that the others can take its load.
A window counts only once it has been watched whole since the last scale or refusal, so one
decision is not taken twice on the same evidence; a window of 0 reads the latest sample (and
an idle window of 0 never finds the ranks saturated: one sample is no share of time)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from parashift.wire import protocol as p

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoscaleConfig:
    min_size: int
    max_size: int
    up_tokens: int = 2048
    up_window_s: float = 10.0
    idle_window_s: float = 60.0
    # one rank fewer only if the rest would have been busy at most this share of the time;
    # one more once the ranks are busy this share of the time or more
    down_busy: float = 0.75
    up_busy: float = 0.95

    def __post_init__(self) -> None:
        if not 1 <= self.min_size <= self.max_size:
            raise ValueError(f"--data-parallel-size-min {self.min_size} must be within 1.."
                             f"--data-parallel-size-max ({self.max_size})")
        if self.up_tokens < 1:
            raise ValueError("--autoscale-up-tokens must be >= 1")
        if self.up_window_s < 0 or self.idle_window_s < 0:
            raise ValueError("--autoscale-up-window and --autoscale-idle-window must be >= 0")
        if not 0.0 < self.down_busy < self.up_busy <= 1.0:
            raise ValueError("the autoscaler's busy shares need 0 < down_busy < up_busy <= 1")


@dataclass(frozen=True)
class Decision:
    size: int
    reason: str


@dataclass(frozen=True)
class _Sample:
    at: float
    busy_ranks: int  # ranks holding a request
    backlog: float  # prompt tokens waiting per rank


class Autoscaler:
    def __init__(self, config: AutoscaleConfig):
        self.config = config
        self.samples: deque[_Sample] = deque()

    def restart_windows(self) -> None:
        self.samples.clear()

    def _mean(self, now: float, window: float, field: str) -> float | None:
        """The time-weighted mean of a sampled value over the last `window` seconds; None
        until that much has been watched."""
        first = self.samples[0]
        if now - first.at < window:
            return None
        if window == 0:
            return float(getattr(self.samples[-1], field))
        start, samples = now - window, list(self.samples)
        ends = [s.at for s in samples[1:]] + [now]
        return sum(getattr(s, field) * (end - max(s.at, start))
                   for s, end in zip(samples, ends, strict=True) if end > start) / window

    def decide(self, now: float, size: int, loads: dict[int, p.EngineLoad]) -> Decision | None:
        """`loads`: the latest load of each rank in the deployment (ranks 0..size-1)."""
        cfg = self.config
        stats = [loads[r].stats for r in range(size) if r in loads]
        busy = sum(1 for s in stats if s.num_waiting or s.num_running)
        self.samples.append(_Sample(now, busy, sum(s.prefill_tokens_left for s in stats) / size))
        oldest = now - max(cfg.up_window_s, cfg.idle_window_s)
        while len(self.samples) > 1 and self.samples[1].at <= oldest:
            self.samples.popleft()
        backlog = self._mean(now, cfg.up_window_s, "backlog")
        if backlog is not None and backlog > cfg.up_tokens and size < cfg.max_size:
            return Decision(size + 1, f"{backlog:.0f} prompt tokens waiting per rank on average "
                                      f"over {cfg.up_window_s:g} s, above {cfg.up_tokens}")
        busy_ranks = self._mean(now, cfg.idle_window_s, "busy_ranks")
        calm = self._mean(now, cfg.idle_window_s, "backlog")
        if busy_ranks is None or calm is None:
            return None
        if cfg.idle_window_s and busy_ranks >= cfg.up_busy * size and size < cfg.max_size:
            return Decision(size + 1, f"{busy_ranks:.2f} of {size} ranks busy on average over "
                                      f"{cfg.idle_window_s:g} s: saturated")
        if size <= cfg.min_size:
            return None
        if busy_ranks <= cfg.down_busy * (size - 1) and calm < cfg.up_tokens / 4:
            return Decision(size - 1, f"{busy_ranks:.2f} of {size} ranks busy on average over "
                                      f"{cfg.idle_window_s:g} s: {size - 1} would have been "
                                      f"busy {busy_ranks / (size - 1):.0%} of the time")
        return None

"""The autoscaler (--data-parallel-size-min with --data-parallel-size-max): in the launcher,
from the coordinator's load vectors, it decides a scale the launcher then runs as one asked for
by hand (runtime/scale.py, which refuses a rank the machine's memory cannot hold).

- up, one rank at a time: while the prompt tokens waiting per rank stay above
  `up_tokens` for `up_window_s` (a backlog that lasts, not a burst the ranks absorb);
- down, one rank at a time: while some rank has held no request for `idle_window_s` and the
  backlog is under a quarter of `up_tokens` (the band between is the hysteresis);
- every window starts again after a scale or a refusal, so one decision is not taken twice on
  the same evidence."""

from __future__ import annotations

import logging
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

    def __post_init__(self) -> None:
        if not 1 <= self.min_size <= self.max_size:
            raise ValueError(f"--data-parallel-size-min {self.min_size} must be within 1.."
                             f"--data-parallel-size-max ({self.max_size})")
        if self.up_tokens < 1:
            raise ValueError("--autoscale-up-tokens must be >= 1")
        if self.up_window_s < 0 or self.idle_window_s < 0:
            raise ValueError("--autoscale-up-window and --autoscale-idle-window must be >= 0")


@dataclass(frozen=True)
class Decision:
    size: int
    reason: str


class Autoscaler:
    def __init__(self, config: AutoscaleConfig):
        self.config = config
        self.backlog_since: float | None = None
        self.idle_since: dict[int, float] = {}  # rank -> since when it has held nothing

    def restart_windows(self) -> None:
        self.backlog_since = None
        self.idle_since.clear()

    def decide(self, now: float, size: int, loads: dict[int, p.EngineLoad]) -> Decision | None:
        """`loads`: the latest load of each rank in the deployment (ranks 0..size-1)."""
        cfg = self.config
        backlog = sum(loads[r].stats.prefill_tokens_left for r in range(size) if r in loads)
        per_rank = backlog / size
        if per_rank > cfg.up_tokens:
            self.backlog_since = self.backlog_since if self.backlog_since is not None else now
        else:
            self.backlog_since = None
        for rank in range(size):
            load = loads.get(rank)
            if load is not None and (load.stats.num_waiting or load.stats.num_running):
                self.idle_since.pop(rank, None)
            else:
                self.idle_since.setdefault(rank, now)
        if (self.backlog_since is not None and size < cfg.max_size
                and now - self.backlog_since >= cfg.up_window_s):
            return Decision(size + 1, f"{per_rank:.0f} prompt tokens waiting per rank, above "
                                      f"{cfg.up_tokens} for {now - self.backlog_since:.1f} s")
        idle = sorted(r for r, since in self.idle_since.items()
                      if r < size and now - since >= cfg.idle_window_s)
        if idle and size > cfg.min_size and per_rank < cfg.up_tokens / 4:
            return Decision(size - 1, f"dp{idle[0]} held no request for "
                                      f"{now - self.idle_since[idle[0]]:.1f} s")
        return None

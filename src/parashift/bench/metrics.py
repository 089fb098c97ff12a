"""The arithmetic of a benchmark run, on plain per-request records: throughput, latency
percentiles, TPOT = (e2e - ttft) / (output tokens - 1), inter-token latencies, goodput under
SLOs. Pure functions, so that they can be checked on synthetic timelines."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int  # tokens the request asked for
    start: float = 0.0  # seconds since the run began
    ttft: float | None = None  # time to the first token
    e2e: float | None = None  # time to the last byte
    itl: list[float] = field(default_factory=list)  # gaps between output chunks, seconds
    generated: int = 0  # output tokens received (the server's usage count when it gives one)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if not self.ok or self.ttft is None or self.generated < 2:
            return None
        return (self.e2e - self.ttft) / (self.generated - 1)


def distribution(values: list[float], scale: float = 1e3) -> dict[str, float]:
    """mean, median, p90, p99 (and min/max) of `values`, scaled (seconds -> ms)."""
    if not values:
        return {}
    arr = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(arr.mean()), "median": float(np.median(arr)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99)),
            "min": float(arr.min()), "max": float(arr.max())}


def meets_slo(record: RequestRecord, slos: dict[str, float]) -> bool:
    """`slos` in milliseconds: ttft, tpot, e2e (any subset)."""
    if not record.ok:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2e": record.e2e}
    for name, limit_ms in slos.items():
        value = values[name]
        if value is not None and value * 1e3 > limit_ms:
            return False
    return True


def summarize(records: list[RequestRecord], duration: float,
              slos: dict[str, float] | None = None) -> dict:
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    output_tokens = sum(r.generated for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    reasons: dict[str, int] = {}  # numbers masked, so that "token id 5 ..." errors group
    for r in failed:
        reason = re.sub(r"\d+", "N", r.error or "no response")
        reasons[reason] = reasons.get(reason, 0) + 1
    summary = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(failed),
        "failure_reasons": reasons,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration
        if duration > 0 else 0.0,
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "e2e_ms": distribution([r.e2e for r in done]),
    }
    if slos:
        good = sum(meets_slo(r, slos) for r in records)
        summary["goodput"] = {"slos_ms": slos, "requests": good,
                              "request_rate": good / duration if duration > 0 else 0.0}
    return summary


def parse_goodput(items: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"--goodput {item!r}: use ttft:MS, tpot:MS or e2e:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be > 0 ms")
    return slos


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of `a`'s output tokens inside the common prefix with `b`, request by request:
    how far two greedy runs of the same requests agree."""
    same = 0
    for x, y in zip(a, b, strict=True):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        same += k
    return same / max(1, sum(len(x) for x in a))

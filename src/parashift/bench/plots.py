"""The PNGs of `--plot` (matplotlib, headless): latency CDFs for serve, throughput bars with
the baseline, latency of a batch, and throughput against p99 latency for a sweep."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display on servers; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from parashift.bench.metrics import RequestRecord  # noqa: E402


def _cdf(ax, values_ms: list[float], label: str | None = None) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)


def serve_cdfs(path: str, runs: dict[str, list[RequestRecord]], title: str) -> None:
    """2 x 2 latency CDFs (TTFT, TPOT, ITL, end-to-end); one line per run (e.g. per rate)."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    metrics = (("TTFT", lambda r: [r.ttft]), ("TPOT", lambda r: [r.tpot]),
               ("ITL", lambda r: r.itl), ("End-to-end", lambda r: [r.e2e]))
    for ax, (name, get) in zip(axes.flat, metrics, strict=True):
        for label, records in runs.items():
            values = [v * 1e3 for r in records if r.ok for v in get(r) if v is not None]
            _cdf(ax, values, label)
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes.flat[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def throughput_bars(path: str, bars: dict[str, float], title: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(bars)
    rects = ax.bar(names, [bars[n] for n in names], color=["tab:blue", "tab:gray"][:len(names)])
    ax.bar_label(rects, fmt="%.1f")
    ax.set_ylabel("total tokens / s")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def latency_cdf(path: str, latencies_s: list[float], title: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    _cdf(ax, [t * 1e3 for t in latencies_s])
    ax.set_xlabel("batch latency, ms")
    ax.set_ylabel("fraction of iterations")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep(path: str, points: list[tuple[str, float, float, float]], title: str) -> None:
    """points: (rate label, output tok/s, p99 TTFT ms, p99 end-to-end ms)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [p[1] for p in points]
    ax.plot(xs, [p[2] for p in points], "o-", label="p99 TTFT")
    ax.plot(xs, [p[3] for p in points], "s-", label="p99 end-to-end")
    for label, x, _, y in points:
        ax.annotate(f"rate {label}", (x, y), textcoords="offset points", xytext=(4, 4),
                    fontsize=8)
    ax.set_xlabel("output tokens / s")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

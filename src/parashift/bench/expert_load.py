"""The expert load a `bench serve` run caused on a parashift server: each engine's own tokens
routed to each expert (parashift_expert_routed_tokens in /metrics), before and after the run.
Another server (vLLM, or parashift without expert parallel) has no such series: nothing is
shown."""

from __future__ import annotations

import re
import time
import urllib.request

_SERIES = re.compile(r'^parashift_expert_routed_tokens\{engine="(dp\d+)",expert="(\d+)"\} (\S+)$',
                     re.MULTILINE)
_IN_WAVE = re.compile(r'^parashift_lockstep_in_wave\{engine="dp\d+"\} 1(\.0)?$', re.MULTILINE)
_MAX_BYTES = 16 << 20
SETTLE_S = 10.0  # an engine reports its counts as its wave ends, a step after the last token


def scrape(base_url: str, api_key: str | None = None) -> dict[tuple[str, int], float]:
    """(engine, expert) -> tokens, from the server's /metrics ({} if it has none), once no
    engine is in a wave (or after SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while (text := _metrics(base_url, api_key)) and _IN_WAVE.search(text) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    return {(engine, int(expert)): float(value)
            for engine, expert, value in _SERIES.findall(text)}


def _metrics(base_url: str, api_key: str | None) -> str:
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    if not url.startswith(("http://", "https://")):
        return ""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"}
                                     if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # nosec B310
            return response.read(_MAX_BYTES).decode(errors="replace")
    except OSError:
        return ""


def expert_load(before: dict[tuple[str, int], float], after: dict[tuple[str, int], float]
                ) -> dict[str, list[int]]:
    """Each engine's tokens per expert during the run (expert ids in order)."""
    engines: dict[str, dict[int, int]] = {}
    for (engine, expert), value in after.items():
        engines.setdefault(engine, {})[expert] = round(value - before.get((engine, expert), 0))
    return {engine: [counts.get(e, 0) for e in range(max(counts) + 1)]
            for engine, counts in sorted(engines.items())}


def format_load(load: dict[str, list[int]]) -> str:
    """One line per engine and the whole group's, with its imbalance (the busiest expert's
    tokens over the mean: 1.0 is even)."""
    if not load:
        return ""
    width = max(len(counts) for counts in load.values())
    total = [sum(counts[e] for counts in load.values() if e < len(counts))
             for e in range(width)]
    lines = ["expert load (tokens routed to each expert, summed over the MoE layers):"]
    for name, counts in [*load.items(), ("all", total)]:
        mean = sum(counts) / len(counts) if counts else 0.0
        imbalance = f"{max(counts) / mean:.2f}" if mean else "-"
        lines.append(f"  {name:<5} imbalance {imbalance:>5}  {' '.join(map(str, counts))}")
    return "\n".join(lines)

"""What every bench command saves and prints: the settings, the software and machine it ran
on, the results and the per-request records (--save-json), and a one-screen summary."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import sys
from typing import Any


def environment() -> dict[str, Any]:
    from importlib.metadata import version

    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    env = {"time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "parashift": version("parashift"), "torch": torch.__version__,
           "transformers": transformers.__version__, "python": sys.version.split()[0],
           "platform": platform.platform(), "cpu": cpu, "cores": len(os.sched_getaffinity(0))}
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def save_json(path: str, command: str, settings: dict[str, Any], results: dict[str, Any],
              records: list | None = None) -> None:
    doc = {"command": command, "settings": settings, "environment": environment(),
           "results": results}
    if records is not None:
        doc["requests"] = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else r
                           for r in records]
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)


def format_serve(summary: dict[str, Any], title: str) -> str:
    lines = [f"{'=' * 20} {title} {'=' * 20}",
             f"{'Successful requests:':<34}{summary['completed']}",
             f"{'Failed requests:':<34}{summary['failed']}"]
    for reason, count in summary["failure_reasons"].items():
        lines.append(f"  {count} x {reason}")
    lines += [f"{'Duration (s):':<34}{summary['duration_s']:.2f}",
              f"{'Input tokens:':<34}{summary['input_tokens']}",
              f"{'Generated tokens:':<34}{summary['output_tokens']}",
              f"{'Request throughput (req/s):':<34}{summary['request_throughput']:.2f}",
              f"{'Output token throughput (tok/s):':<34}{summary['output_throughput']:.1f}",
              f"{'Total token throughput (tok/s):':<34}{summary['total_token_throughput']:.1f}"]
    if "goodput" in summary:
        g = summary["goodput"]
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in g["slos_ms"].items())
        lines.append(f"{'Goodput (req/s):':<34}{g['request_rate']:.2f}  ({slos})")
    for key, name in (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token"),
                      ("itl_ms", "Inter-token latency"), ("e2e_ms", "End-to-end latency")):
        d = summary[key]
        if d:
            lines.append(f"{name + ' (ms):':<34}mean {d['mean']:.1f}  median {d['median']:.1f}"
                         f"  p90 {d['p90']:.1f}  p99 {d['p99']:.1f}")
    return "\n".join(lines)

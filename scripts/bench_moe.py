"""`python scripts/bench_moe.py`: expert parallel against replicated experts, served. A
random-weight Mixtral-shaped model (8 experts, top-2, hidden 1024, 8 layers by default) under
`dp2xep` (each engine holds half the experts, tokens dispatched between them every MoE layer,
the engines in lockstep waves) and under `dp2` (every engine holds every expert), one core per
engine. Per layout: the weights and the peak resident memory of each engine, the expert share of
the weights (from `plan`, which the plan-truth tests hold equal to the engine), throughput and
TTFT/TPOT at a fixed concurrency (a closed loop over streaming HTTP), the share of step time in
the dispatch / combine collectives, and the lockstep waves and dummy steps."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Annotated, Any

import typer
from study_options import Dtype, InputLenRange, OutputLenRange, Repeat

from parashift.bench.options import SaveJson
from parashift.cli_options import ModelArg, fail, parse_counts, setup_logging

LAYOUTS = {"dp2 (experts replicated)": "dp2", "dp2xep": "dp2xep"}
RUN_ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "256MiB"]


def engine_peak_rss(server_pid: int) -> dict[int, int]:
    """Rank -> peak resident bytes (VmHWM) of the server's engine processes (Linux /proc)."""
    from study_server import process_title, process_tree

    peaks = {}
    for pid in process_tree(server_pid):
        m = re.match(r"parashift-engine-dp(\d+)", process_title(pid))
        try:
            with open(f"/proc/{pid}/status") as f:
                hwm = re.search(r"VmHWM:\s+(\d+)", f.read())
        except OSError:
            continue
        if m and hwm:
            peaks[int(m.group(1))] = int(hwm.group(1)) * 1024
    return peaks


def lockstep_metrics(url: str) -> dict[str, dict[int, float]]:
    """The lockstep gauges of GET /metrics: name -> rank -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:  # nosec B310
        text = r.read().decode()
    out: dict[str, dict[int, float]] = {}
    for name in ("lockstep_dummy_steps", "lockstep_waves", "lockstep_step_seconds",
                 "expert_dispatch_seconds"):
        for rank, value in re.findall(rf'^parashift_{name}{{engine="dp(\d+)"}} (\S+)$', text,
                                      re.MULTILINE):
            out.setdefault(name, {})[int(rank)] = float(value)
    return out


def weight_bytes(lines: list[str]) -> dict[int, int]:
    """Rank -> weight bytes, from the launcher's "engine dpN ready ... weight bytes" lines."""
    out = {}
    for line in lines:
        m = re.search(r"engine dp(\d+) ready: .*weight bytes per worker \[([\d, ]+)\]", line)
        if m:
            out[int(m.group(1))] = sum(int(v) for v in m.group(2).split(","))
    return out


def plan_experts(model: str, strategy: str, dtype: str) -> dict[str, Any]:
    """`parashift plan --json`'s expert options for this layout (bench sits beside plan)."""
    done = subprocess.run([sys.executable, "-m", "parashift.cli", "plan",  # nosec B603
                           model, "--strategy", strategy, "--device", "cpu", "--json",
                           "--dtype", dtype, *RUN_ARGS],
                          capture_output=True, text=True, timeout=300)
    if not done.stdout.strip():
        raise ValueError(f"parashift plan failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)["expert_options"]


def measure(model: str, strategy: str, dtype: str, requests, concurrency: int, repeat: int,
            vocab: int) -> dict[str, Any]:
    from study_server import reset_prefix_cache, running_server, warm_up

    from parashift.bench.metrics import summarize
    from parashift.bench.serve_client import run_load

    runs = []
    with running_server(model, ["--strategy", strategy, "--dtype", dtype, *RUN_ARGS]) as server:
        warm_up(server.url, vocab)
        for _ in range(repeat):
            reset_prefix_cache(server.url)
            before = lockstep_metrics(server.url)
            records, elapsed = asyncio.run(run_load(server.url, None, requests, float("inf"),
                                                    max_concurrency=concurrency))
            summary = summarize(records, elapsed)
            if summary["failed"]:
                raise RuntimeError(f"{summary['failed']} requests failed: "
                                   f"{summary['failure_reasons']}")
            after = _settled_metrics(server.url)
            delta = {name: {r: v - before.get(name, {}).get(r, 0.0) for r, v in ranks.items()}
                     for name, ranks in after.items()}
            runs.append((summary, delta))
            typer.echo(f"  {strategy}: {summary['total_token_throughput']:.1f} tok/s, TPOT "
                       f"{summary['tpot_ms']['median']:.1f} ms")
        peaks = engine_peak_rss(server.proc.pid)
        weights = weight_bytes(server.lines)
    summary, delta = sorted(runs, key=lambda r: r[0]["total_token_throughput"])[len(runs) // 2]
    tput = [s["total_token_throughput"] for s, _ in runs]
    row = {"strategy": strategy, "total_tokens_per_s": tput,
           "median_total_tokens_per_s": statistics.median(tput),
           "min_total_tokens_per_s": min(tput),
           "median_tpot_ms": summary["tpot_ms"]["median"],
           "median_ttft_ms": summary["ttft_ms"]["median"],
           "weight_bytes_per_rank": weights, "peak_rss_bytes_per_rank": peaks}
    steps = delta.get("lockstep_step_seconds", {})
    if any(steps.values()):
        dispatch = delta["expert_dispatch_seconds"]
        row.update(dispatch_share={r: dispatch[r] / s for r, s in steps.items() if s},
                   dummy_steps=delta["lockstep_dummy_steps"],
                   waves=delta["lockstep_waves"])
    return row


def _settled_metrics(url: str) -> dict[str, dict[int, float]]:
    """After a run, once the engines have reported their last wave (within ~100 ms)."""
    last = lockstep_metrics(url)
    for _ in range(20):
        time.sleep(0.3)
        now = lockstep_metrics(url)
        if now == last:
            break
        last = now
    return last


def moe(
    model: ModelArg = None,
    dtype: Dtype = "auto",
    num_prompts: Annotated[int, typer.Option("--num-prompts")] = 96,
    concurrency: Annotated[int, typer.Option(help="requests in flight")] = 32,
    input_len_range: InputLenRange = "32:128",
    output_len_range: OutputLenRange = "64:64",
    repeat: Repeat = 3,
    dispatch_tokens: Annotated[str, typer.Option(
        help="tokens per rank at which to time the two dispatch methods alone "
             "(all-gather+reduce-scatter, all-to-all); 'none' to skip")] = "16,64,512",
    save_json: SaveJson = None,
) -> None:
    """dp2xep against dp2 with replicated experts: memory per rank, throughput and TPOT at a
    concurrency, dispatch share of the step, dummy steps. MODEL: an MoE checkpoint (default: a
    random Mixtral-shaped model, 8 experts, top-2, hidden 1024, 8 layers)."""
    setup_logging()
    from random_model import random_mixtral
    from study_options import random_workload

    from parashift.bench import report

    if concurrency < 1 or repeat < 1:
        fail("--concurrency and --repeat must be >= 1")
    token_counts = ([] if dispatch_tokens == "none"
                    else parse_counts(dispatch_tokens, "--dispatch-tokens"))
    folder = model or random_mixtral(hidden=1024, intermediate=2048, layers=8, heads=16,
                                     kv_heads=4, experts=8, top_k=2, vocab=32000)
    try:
        requests, vocab = random_workload(folder, num_prompts, input_len_range,
                                          output_len_range, 0)
        options = plan_experts(folder, "dp2xep", dtype)
        rows = {}
        for name, strategy in LAYOUTS.items():
            typer.echo(f"{name} ...")
            rows[name] = measure(folder, strategy, dtype, requests, concurrency, repeat, vocab)
    except (ValueError, RuntimeError) as e:
        fail(str(e))
    replicated, sharded = (rows[name] for name in LAYOUTS)
    non_expert = (options["with ep"]["weight_bytes_per_rank"]
                  - options["with ep"]["expert_bytes_per_rank"])
    for name, row in rows.items():
        row["expert_bytes_per_rank"] = {r: w - non_expert
                                        for r, w in row["weight_bytes_per_rank"].items()}
        typer.echo(f"{name:26s} {row['median_total_tokens_per_s']:8.1f} tok/s (min "
                   f"{row['min_total_tokens_per_s']:.1f}), TPOT {row['median_tpot_ms']:.1f} ms,"
                   f" TTFT {row['median_ttft_ms']:.0f} ms; per rank: weights "
                   + ", ".join(f"{w / 2**20:.0f}" for w in row["weight_bytes_per_rank"].values())
                   + " MiB, experts "
                   + ", ".join(f"{w / 2**20:.0f}" for w in row["expert_bytes_per_rank"].values())
                   + " MiB, peak RSS "
                   + ", ".join(f"{w / 2**20:.0f}" for w in row["peak_rss_bytes_per_rank"].values())
                   + " MiB")
        if "dispatch_share" in row:
            typer.echo("  dispatch + combine: " + ", ".join(
                f"dp{r} {v:.1%}" for r, v in row["dispatch_share"].items()) + " of step time;"
                " dummy steps " + ", ".join(f"dp{r} {v:.0f}" for r, v in row["dummy_steps"].items())
                + f" over {max(row['waves'].values()):.0f} waves (each ends with one)")
    ratio = sharded["median_total_tokens_per_s"] / replicated["median_total_tokens_per_s"]
    memory = (max(sharded["expert_bytes_per_rank"].values())
              / max(replicated["expert_bytes_per_rank"].values()))
    typer.echo(f"dp2xep over dp2: throughput {ratio:.2f}x, expert memory per rank {memory:.2f}x")
    dispatch = dispatch_comparison(folder, token_counts)
    if save_json:
        report.save_json(save_json, "moe", {
            "model": model or folder, "dtype": dtype, "num_prompts": num_prompts,
            "concurrency": concurrency, "input_len_range": input_len_range,
            "output_len_range": output_len_range, "repeat": repeat},
            {"layouts": rows, "plan_expert_options": options, "throughput_ratio": ratio,
             "expert_memory_ratio": memory, "dispatch_methods": dispatch})


def dispatch_comparison(model: str, token_counts: list[int]) -> dict[int, dict[str, float]]:
    from moe_dispatch import time_dispatch

    from parashift.models.loader import load_hf_config

    cfg = load_hf_config(model)
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    out = {}
    for tokens in token_counts:
        out[tokens] = time_dispatch(tokens, cfg.hidden_size, experts, cfg.num_experts_per_tok)
        typer.echo(f"one layer's token exchange, {tokens} tokens per rank: " + ", ".join(
            f"{name} {seconds * 1e3:.2f} ms" for name, seconds in out[tokens].items()))
    return out


if __name__ == "__main__":
    typer.run(moe)

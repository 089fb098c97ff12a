"""`python scripts/bench_pipeline.py`: pipeline parallel on CPU. pp2 with one core per stage
against pp1 on one core and pp1 on two, for a prefill-heavy and a decode-heavy workload, each at
several concurrencies (a closed loop: `c` requests in flight, a new one as soon as one
finishes).

Per run: throughput, TTFT and TPOT, and for pp > 1 the measured bubble (the share of the run a
stage spends outside its steps, averaged over the stages) beside the bubble `plan` predicts for
that concurrency (plan/bubble.py), and the stage-to-stage transfer time of one step's
activations as a share of a step."""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import subprocess
import sys
import time
from typing import Annotated, Any

import typer
from study_options import Dtype, Repeat
from study_probes import EXTENSION

from parashift.bench.options import SaveJson
from parashift.cli_options import ModelArg, fail, parse_counts, setup_logging

# name -> (prompt tokens, output tokens) per request
WORKLOADS = {"prefill-heavy": (256, 4), "decode-heavy": (16, 64)}
MAX_MODEL_LEN, KV_CACHE_MEMORY = 1024, 512 << 20  # every layout's engine, and what plan is told
WAVES = 8  # requests per run, per unit of concurrency
PLAN_WORKLOAD = {"prefill-heavy": "prefill", "decode-heavy": "decode"}  # plan's bubble keys
# name -> (strategy, torch threads per worker): pp1 runs in this process
LAYOUTS = {"pp1 1 core": ("pp1", 1), "pp1 2 cores": ("pp1", 2), "pp2 1 core/stage": ("pp2", 1)}


@dataclasses.dataclass
class LoopResult:
    elapsed_s: float
    ttft_s: list[float]
    tpot_s: list[float]
    num_tokens: int  # prompt + output tokens of every request
    num_output_tokens: int


def closed_loop(core, prompts: list[list[int]], output_len: int, concurrency: int
                ) -> LoopResult:
    """Keep `concurrency` requests in the engine until all `prompts` are done."""
    from parashift.engine.request import Request
    from parashift.types.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    pending = list(enumerate(prompts))[::-1]
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    ttft, tpot = [], []
    start = time.perf_counter()

    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < concurrency:
            index, prompt = pending.pop()
            added[str(index)] = time.perf_counter()
            core.add_request(Request(str(index), prompt, params, None))
            in_flight += 1
        for out in core.step():
            now = time.perf_counter()
            if out.request_id not in first:
                first[out.request_id] = now
                ttft.append(now - added[out.request_id])
            if out.finish_reason is not None:
                in_flight -= 1
                if output_len > 1:
                    tpot.append((now - first[out.request_id]) / (output_len - 1))
    elapsed = time.perf_counter() - start
    return LoopResult(elapsed, ttft, tpot, sum(len(p) + output_len for p in prompts),
                      len(prompts) * output_len)


def transfer_seconds(executor, num_tokens: int, repeat: int = 10) -> float:
    """One step's activations ([2, num_tokens, hidden]) from stage 0 to stage 1, measured on
    the receiver over `repeat` back-to-back transfers."""
    times = executor.collective_rpc("time_pp_transfer", num_tokens, repeat)
    return max(t for t in times if t is not None)


def measure(model: str | None, layout: str, dtype: str, concurrencies: list[int],
            num_requests: int | None, repeat: int, workloads: list[str]
            ) -> list[dict[str, Any]]:
    from parashift import LLM

    strategy, threads = LAYOUTS[layout]
    llm = LLM(model, dtype=dtype, strategy=strategy, num_threads=threads,
              max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_CACHE_MEMORY,
              worker_extension_cls=EXTENSION)
    rows = []
    try:
        core, config = llm.engine, llm.config
        vocab = config.model.vocab_size
        pipelined = config.parallel.strategy.size("pp") > 1
        serial = itertools.count()  # a distinct prompt for every request of every run
        for workload in workloads:
            prompt_len, output_len = WORKLOADS[workload]
            predicted = (plan_bubbles(config.model.path, strategy, concurrencies, prompt_len,
                                      output_len) if pipelined else {})
            for c in concurrencies:
                # Eight waves by default: the first wave arrives at once and the last drains,
                # and with two the pipeline barely leaves that transient (see BENCHMARKS).
                n = num_requests or max(8, WAVES * c)
                runs = []
                for r in range(repeat + 1):  # the first, a short one, warms up
                    count = min(n, 8) if r == 0 else n
                    prompts = [[(1000 + 7919 * next(serial) + 31 * j) % vocab
                                for j in range(prompt_len)] for _ in range(count)]
                    core.reset_prefix_cache()  # no run may hit another's prompts
                    if pipelined:
                        core.executor.collective_rpc("take_stage_stats")
                    loop = closed_loop(core, prompts, output_len, c)
                    stats = (core.executor.collective_rpc("take_stage_stats") if pipelined
                             else [])
                    if r:
                        runs.append((loop, stats))
                rows.append(_row(layout, workload, c, runs, core,
                                 predicted.get(PLAN_WORKLOAD[workload], {}).get(str(c))))
                typer.echo(_line(rows[-1]))
    finally:
        llm.shutdown()
    return rows


def plan_bubbles(model: str, strategy: str, concurrencies: list[int], prompt_len: int,
                 output_len: int) -> dict[str, dict[str, float]]:
    """What `parashift plan --json` predicts for this layout: {"decode" | "prefill":
    {concurrency: bubble}} (bench sits beside plan, so it asks the command)."""
    done = subprocess.run(  # nosec B603
        [sys.executable, "-m", "parashift.cli", "plan", model, "--strategy", strategy,
         "--device", "cpu", "--json", "--concurrency", ",".join(map(str, concurrencies)),
         "--prompt-len", str(prompt_len), "--output-len", str(output_len),
         "--max-model-len", str(MAX_MODEL_LEN),
         "--kv-cache-memory", str(KV_CACHE_MEMORY)], capture_output=True, text=True, timeout=300)
    if done.returncode not in (0, 1) or not done.stdout.strip():  # 1: printed, "does not fit"
        raise ValueError(f"parashift plan failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)["pipeline_bubble"]


def _row(layout: str, workload: str, c: int, runs: list[tuple[LoopResult, list[dict]]], core,
         plan_bubble: float | None) -> dict[str, Any]:
    tok_s = [loop.num_tokens / loop.elapsed_s for loop, _ in runs]
    out_s = [loop.num_output_tokens / loop.elapsed_s for loop, _ in runs]
    median_run = sorted(runs, key=lambda run: run[0].num_tokens / run[0].elapsed_s)[
        len(runs) // 2]
    loop, stats = median_run
    row = {"layout": layout, "workload": workload, "concurrency": c,
           "tokens_per_s": tok_s, "median_tokens_per_s": statistics.median(tok_s),
           "min_tokens_per_s": min(tok_s), "median_output_tokens_per_s": statistics.median(out_s),
           "median_ttft_ms": statistics.median(loop.ttft_s) * 1e3,
           "median_tpot_ms": statistics.median(loop.tpot_s) * 1e3 if loop.tpot_s else None}
    if any(s["steps"] for s in stats):  # a pipeline that ran steps
        bubbles = [statistics.mean(1 - s["busy_seconds"] / lp.elapsed_s for s in st)
                   for lp, st in runs]
        steps = max(s["steps"] for s in stats)
        step_s = max(s["busy_seconds"] for s in stats) / steps
        per_step_tokens = loop.num_tokens / steps
        transfer = transfer_seconds(core.executor, max(1, round(per_step_tokens)))
        row.update(measured_bubble=statistics.median(bubbles),
                   plan_bubble=plan_bubble,
                   step_ms=step_s * 1e3, tokens_per_step=per_step_tokens,
                   transfer_ms=transfer * 1e3, transfer_share=transfer / step_s)
    return row


def _line(row: dict[str, Any]) -> str:
    text = (f"{row['layout']:>17} {row['workload']:>13} c={row['concurrency']:<3} "
            f"{row['median_tokens_per_s']:8.1f} tok/s (min {row['min_tokens_per_s']:.1f}), "
            f"TTFT {row['median_ttft_ms']:.0f} ms"
            + (f", TPOT {row['median_tpot_ms']:.1f} ms" if row["median_tpot_ms"] else ""))
    if "measured_bubble" in row:
        plan = row["plan_bubble"]
        text += (f"; bubble {row['measured_bubble']:.0%} (plan "
                 f"{'-' if plan is None else f'{plan:.0%}'}), "
                 f"transfer {row['transfer_ms']:.2f} ms = {row['transfer_share']:.1%} of a "
                 f"{row['step_ms']:.0f} ms step")
    return text


def _choose(text: str, known: dict[str, Any], flag: str) -> list[str]:
    chosen = [name.strip() for name in text.split(",")]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        fail(f"{flag}: unknown {unknown}; known: {', '.join(known)}")
    return chosen


def pipeline(
    model: ModelArg = None,
    concurrency: Annotated[str, typer.Option(help="requests in flight, e.g. 1,4,32")] = "1,4,32",
    num_requests: Annotated[int | None, typer.Option(
        "--num-requests",
        help=f"requests per run (default: {WAVES} times the concurrency, at least 8)")
                            ] = None,
    layouts: Annotated[str, typer.Option(help="comma-separated: " + ", ".join(LAYOUTS))
                       ] = ",".join(LAYOUTS),
    workloads: Annotated[str, typer.Option(help="comma-separated: " + ", ".join(WORKLOADS))
                         ] = ",".join(WORKLOADS),
    dtype: Dtype = "auto",
    repeat: Repeat = 2,
    save_json: SaveJson = None,
) -> None:
    """pp2 (one core per stage) against pp1 on one and on two cores: throughput, TTFT/TPOT,
    measured and predicted bubble, stage-to-stage transfer share."""
    setup_logging()
    from parashift.bench import report

    levels = parse_counts(concurrency, "--concurrency")
    chosen = _choose(layouts, LAYOUTS, "--layouts")
    chosen_workloads = _choose(workloads, WORKLOADS, "--workloads")
    if (num_requests is not None and num_requests < 1) or repeat < 1:
        fail("--num-requests and --repeat must be >= 1")
    rows = []
    try:
        for layout in chosen:
            typer.echo(f"{layout} ...")
            rows += measure(model, layout, dtype, levels, num_requests, repeat,
                            chosen_workloads)
    except ValueError as e:
        fail(str(e))
    by_key = {(r["layout"], r["workload"], r["concurrency"]): r for r in rows}
    for (layout, workload, c), r in by_key.items():
        base = by_key.get(("pp1 1 core", workload, c))
        if base is not None and layout != "pp1 1 core":
            typer.echo(f"{layout} over pp1 1 core, {workload} c={c}: "
                       f"{r['median_tokens_per_s'] / base['median_tokens_per_s']:.2f}x")
    if save_json:
        report.save_json(save_json, "pipeline", {
            "model": model, "dtype": dtype, "concurrency": levels, "num_requests": num_requests,
            "repeat": repeat, "layouts": chosen,
            "workloads": {w: WORKLOADS[w] for w in chosen_workloads}}, {"results": rows})


if __name__ == "__main__":
    typer.run(pipeline)

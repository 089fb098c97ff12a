"""`python scripts/bench_serving_vs_offline.py`: serving throughput against the offline engine,
in one run. The workload goes through `LLM.generate` in this process, then, with that engine
freed, the same requests are sent at once over HTTP (streaming /v1/completions, token-id
prompts) to a `parashift run` server this command starts."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Annotated, Any

import typer
from study_options import Dtype, InputLenRange, OutputLenRange, Repeat, ServerArgs, served_workload

from parashift.bench.options import NumPrompts, SaveJson, Seed
from parashift.cli_options import ModelArg, fail, setup_logging


def serving_vs_offline(
    model: ModelArg = None,
    dtype: Dtype = "bfloat16",
    num_prompts: NumPrompts = 32,
    input_len_range: InputLenRange = "32:256",
    output_len_range: OutputLenRange = "32:128",
    repeat: Repeat = 1,
    extra: ServerArgs = "",
    skip_offline: Annotated[bool, typer.Option("--skip-offline", help="measure the server only")
                            ] = False,
    seed: Seed = 0,
    save_json: SaveJson = None,
) -> None:
    """Both throughputs, their ratio, and the server's TTFT / TPOT / end-to-end percentiles."""
    setup_logging()
    from study_server import reset_prefix_cache, running_server, send_all, warm_up

    from parashift.bench import report
    from parashift.bench.metrics import distribution
    from parashift.bench.offline import run_throughput
    from parashift.engine.args import EngineArgs, create_config

    if repeat < 1:
        fail("--repeat must be >= 1")
    requests, vocab, extra_args = served_workload(model, num_prompts, input_len_range,
                                                  output_len_range, seed, extra)
    total = sum(r.prompt_len + r.output_len for r in requests)
    out_tokens = sum(r.output_len for r in requests)
    typer.echo(f"workload: {len(requests)} requests, {total} tokens ({out_tokens} output); "
               f"dtype {dtype}")
    off_times: list[float] = []
    if not skip_offline:
        typer.echo("offline ...")
        args = EngineArgs(model=model, dtype=dtype)
        off_times = run_throughput(args, create_config(args), requests, progress=False,
                                   repeat=repeat).elapsed_s
    typer.echo("server ...")
    runs = []
    try:
        with running_server(model, ["--dtype", dtype, *extra_args]) as server:
            warm_up(server.url, vocab)
            for _ in range(repeat):
                reset_prefix_cache(server.url)
                runs.append(send_all(server.url, requests))
    except RuntimeError as e:
        fail(str(e))
    serve_times = [t for t, _ in runs]
    # Latency percentiles of the run whose time is the median.
    records = sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2][1]
    srv_med = statistics.median(serve_times)
    result: dict[str, Any] = {
        "server_args": extra,
        "serve": {"elapsed_s": serve_times, "total_tokens_per_s": total / srv_med,
                  "output_tokens_per_s": out_tokens / srv_med,
                  "ttft_ms": distribution([r.ttft for r in records if r.ttft is not None]),
                  "tpot_ms": distribution([t for r in records if (t := r.tpot) is not None]),
                  "e2e_ms": distribution([r.e2e for r in records])},
        "workload": {"num_requests": len(requests), "total_tokens": total,
                     "output_tokens": out_tokens},
    }
    if off_times:
        off_med = statistics.median(off_times)
        result["offline"] = {"elapsed_s": off_times, "total_tokens_per_s": total / off_med}
        result["ratio_serve_over_offline"] = off_med / srv_med
        typer.echo(f"offline : median {off_med:.2f} s (min {min(off_times):.2f}), "
                   f"{result['offline']['total_tokens_per_s']:.1f} tok/s")
    typer.echo(f"serving : median {srv_med:.2f} s (min {min(serve_times):.2f}), "
               f"{result['serve']['total_tokens_per_s']:.1f} tok/s, "
               f"{result['serve']['output_tokens_per_s']:.1f} output tok/s")
    if off_times:
        typer.echo(f"serving / offline throughput: {result['ratio_serve_over_offline']:.3f}")
    for name in ("ttft", "tpot", "e2e"):
        v = result["serve"][f"{name}_ms"]
        if v:
            typer.echo(f"{name:5s} mean {v['mean']:.0f} ms  p50 {v['median']:.0f}  "
                       f"p90 {v['p90']:.0f}  p99 {v['p99']:.0f}")
    if save_json:
        report.save_json(save_json, "serving-vs-offline", {
            "model": model, "dtype": dtype, "num_prompts": num_prompts,
            "input_len_range": input_len_range, "output_len_range": output_len_range,
            "repeat": repeat, "server_args": extra, "skip_offline": skip_offline,
            "seed": seed}, result,
            [{"run": i, **dataclasses.asdict(r)} for i, (_, recs) in enumerate(runs)
             for r in recs])


if __name__ == "__main__":
    typer.run(serving_vs_offline)

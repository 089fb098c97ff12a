"""`parashift bench throughput | latency | serve | sweep`: the project's measuring
instrument. Every command shows progress, takes --seed, --save-json FILE (settings, versions,
machine, results, per-request records) and --plot FILE.png, and prints a one-screen summary."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from parashift.bench.options import (
    Dataset,
    InputLen,
    InputRange,
    NumPrompts,
    OutputLen,
    OutputRange,
    Plot,
    SaveJson,
    Seed,
    workload,
)
from parashift.bench.serve_cli import serve, sweep
from parashift.cli_options import engine_options, fail, setup_logging

if TYPE_CHECKING:
    from parashift.engine.args import EngineArgs

bench_app = typer.Typer(no_args_is_help=True, help="Measure throughput, latency, serving.")


@bench_app.command()
@engine_options
def throughput(
    engine_args: EngineArgs,
    num_prompts: NumPrompts = 64,
    input_len: InputLen = None,
    output_len: OutputLen = None,
    input_len_range: InputRange = None,
    output_len_range: OutputRange = None,
    dataset: Dataset = None,
    baseline: Annotated[str | None, typer.Option(help="hf: transformers generate, same run")
                        ] = None,
    hf_batch_size: Annotated[int, typer.Option("--hf-batch-size")] = 32,
    seed: Seed = 0,
    save_json: SaveJson = None,
    plot: Plot = None,
) -> None:
    """Offline throughput of the engine (every DP rank for dp > 1), optionally against
    transformers on the same requests."""
    setup_logging()
    from parashift.bench import report
    from parashift.bench.offline import run_throughput
    from parashift.engine.args import create_config, strategy_spec

    if baseline not in (None, "hf"):
        fail(f"--baseline {baseline!r}: the only baseline is hf")
    if hf_batch_size < 1:
        fail("--hf-batch-size must be >= 1")
    try:
        config = create_config(engine_args)
        requests = workload(num_prompts, input_len, output_len, input_len_range,
                             output_len_range, dataset, seed, _tokenizer(config.model),
                             config.model.vocab_size)
    except ValueError as e:
        fail(str(e))
    tokens = sum(r.prompt_len + r.output_len for r in requests)
    out_tokens = sum(r.output_len for r in requests)
    typer.echo(f"{len(requests)} requests, {tokens} tokens ({out_tokens} output); "
               f"strategy {strategy_spec(engine_args)}")
    elapsed = run_throughput(engine_args, requests)
    results = {"parashift": _rates(elapsed, len(requests), tokens, out_tokens)}
    if baseline == "hf":
        from parashift.bench.hf_baseline import run_hf

        hf = run_hf(config.model.path, requests, config.model.dtype,
                    config.device.torch_device, hf_batch_size)
        results["hf"] = _rates(hf, len(requests), tokens, out_tokens)
        results["speedup_over_hf"] = hf / elapsed
    lines = [f"{'':12}{'seconds':>10}{'requests/s':>12}{'total tok/s':>13}{'output tok/s':>14}"]
    for name in ("parashift", "hf"):
        if name in results:
            r = results[name]
            lines.append(f"{name:12}{r['elapsed_s']:>10.2f}{r['requests_per_s']:>12.2f}"
                         f"{r['total_tokens_per_s']:>13.1f}{r['output_tokens_per_s']:>14.1f}")
    if "speedup_over_hf" in results:
        lines.append(f"parashift / hf: {results['speedup_over_hf']:.2f}x")
    typer.echo("\n".join(lines))
    settings = {"model": config.model.path, "strategy": str(strategy_spec(engine_args)),
                "dtype": str(config.model.dtype), "num_prompts": len(requests),
                "dataset": dataset, "seed": seed, "baseline": baseline}
    if save_json:
        report.save_json(save_json, "throughput", settings, results, requests)
    if plot:
        from parashift.bench.plots import throughput_bars

        throughput_bars(plot, {n: results[n]["total_tokens_per_s"] for n in ("parashift", "hf")
                               if n in results}, f"throughput, {len(requests)} requests")


def _rates(elapsed: float, n: int, tokens: int, out_tokens: int) -> dict[str, float]:
    return {"elapsed_s": elapsed, "requests_per_s": n / elapsed,
            "total_tokens_per_s": tokens / elapsed, "output_tokens_per_s": out_tokens / elapsed}


def _tokenizer(model_config):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_config.tokenizer_path)


@bench_app.command()
@engine_options
def latency(
    engine_args: EngineArgs,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 8,
    input_len: Annotated[int, typer.Option("--input-len")] = 32,
    output_len: Annotated[int, typer.Option("--output-len")] = 128,
    iters: Annotated[int, typer.Option(help="timed batches")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed batches first")] = 1,
    seed: Seed = 0,
    save_json: SaveJson = None,
    plot: Plot = None,
) -> None:
    """End-to-end latency of one batch (prefill and every decode step)."""
    setup_logging()
    from parashift.bench import report
    from parashift.bench.metrics import distribution
    from parashift.bench.offline import run_latency
    from parashift.engine.args import strategy_spec

    for flag, value in (("--batch-size", batch_size), ("--input-len", input_len),
                        ("--output-len", output_len), ("--iters", iters)):
        if value < 1:
            fail(f"{flag} must be >= 1")
    if warmup < 0:
        fail("--warmup must be >= 0")
    try:
        engine_args.seed = seed
        if strategy_spec(engine_args).processes().num_engines > 1:
            raise ValueError("latency measures one engine: drop the dp axis")
        if batch_size > engine_args.max_num_seqs:
            raise ValueError(f"--batch-size {batch_size} is above --max-num-seqs "
                             f"{engine_args.max_num_seqs}: one batch would take several steps")
        latencies = run_latency(engine_args, batch_size, input_len, output_len, iters, warmup)
    except ValueError as e:
        fail(str(e))
    stats = distribution(latencies)
    typer.echo(f"batch {batch_size} x ({input_len} in, {output_len} out), {iters} iterations: "
               f"mean {stats['mean']:.1f} ms, median {stats['median']:.1f}, p90 "
               f"{stats['p90']:.1f}, p99 {stats['p99']:.1f} "
               f"({batch_size * output_len / (stats['median'] / 1e3):.1f} output tok/s)")
    results = {"latency_ms": stats, "latencies_s": latencies}
    if save_json:
        report.save_json(save_json, "latency", {
            "model": engine_args.model, "batch_size": batch_size, "input_len": input_len,
            "output_len": output_len, "iters": iters, "warmup": warmup, "seed": seed}, results)
    if plot:
        from parashift.bench.plots import latency_cdf

        latency_cdf(plot, latencies, f"batch {batch_size}: {input_len} in, {output_len} out")


bench_app.command()(serve)
bench_app.command()(sweep)

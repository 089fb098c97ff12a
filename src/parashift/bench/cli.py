"""`parashift bench`: what a user measures, as vLLM's `vllm bench` has it: `throughput`
(offline, the engine alone), `latency` (one batch; `--breakdown` splits a decode step),
`serve` (a load against a running server) and `sweep` (`serve` over request rates). Every
command takes --seed (where it draws a workload) and --save-json FILE (settings, versions,
machine, results), prints a one-screen summary and draws --plot FILE.png. The comparisons
behind docs/BENCHMARKS.md (layouts, kernels, backends, soak) are studies in scripts/."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated

import typer

from parashift.bench.options import Plot, Sampling, SaveJson, Seed, sampling_fields
from parashift.bench.serve_cli import serve, sweep
from parashift.bench.throughput_cli import throughput
from parashift.cli_options import engine_options, fail, setup_logging

if TYPE_CHECKING:
    from parashift.engine.args import EngineArgs

bench_app = typer.Typer(no_args_is_help=True,
                        help="Measure throughput, latency and serving.")
bench_app.command()(throughput)


@bench_app.command()
@engine_options
def latency(
    engine_args: EngineArgs,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 8,
    input_len: Annotated[int, typer.Option("--input-len")] = 32,
    output_len: Annotated[int, typer.Option("--output-len")] = 128,
    iters: Annotated[int, typer.Option(help="timed batches")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed batches first")] = 1,
    breakdown: Annotated[bool, typer.Option(
        "--breakdown", help="then profile a decode step: GEMM, attention, sampling, other "
                            "ops, Python, against the GEMM floor")] = False,
    structured_regex: Annotated[str | None, typer.Option(
        "--structured-regex", help="every request under this regex constraint (e.g. "
        "\"[a-z ]{4096}\": never complete within the batch): the grammar mask's cost, its "
        "own bucket under --breakdown")] = None,
    sampling: Sampling = "",
    seed: Seed = 0,
    save_json: SaveJson = None,
    plot: Plot = None,
) -> None:
    """End-to-end latency of one batch (prefill and every decode step)."""
    setup_logging()
    from parashift import LLM
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
        fields = sampling_fields(sampling)
        if structured_regex is not None:
            from parashift import StructuredOutputsParams

            fields["structured_outputs"] = StructuredOutputsParams(regex=structured_regex)
        if strategy_spec(engine_args).processes().num_engines > 1:
            raise ValueError("latency measures one engine: drop the dp axis")
        if batch_size > engine_args.max_num_seqs:
            raise ValueError(f"--batch-size {batch_size} is above --max-num-seqs "
                             f"{engine_args.max_num_seqs}: one batch would take several steps")
        # one engine (its config resolved once) for the timed batches and the breakdown
        llm = LLM.from_engine_args(dataclasses.replace(engine_args, seed=seed))
    except ValueError as e:
        fail(str(e))
    try:
        latencies = run_latency(llm, batch_size, input_len, output_len, iters, warmup,
                                sampling=fields)
        stats = distribution(latencies)
        typer.echo(f"batch {batch_size} x ({input_len} in, {output_len} out), {iters} "
                   f"iterations: mean {stats['mean']:.1f} ms, median {stats['median']:.1f}, "
                   f"p90 {stats['p90']:.1f}, p99 {stats['p99']:.1f} "
                   f"({batch_size * output_len / (stats['median'] / 1e3):.1f} output tok/s)")
        results = {"latency_ms": stats, "latencies_s": latencies}
        if breakdown:
            from parashift.bench.breakdown import decode_breakdown, format_breakdown

            results["breakdown"] = decode_breakdown(llm, batch_size, input_len, output_len,
                                                    fields)
            typer.echo(format_breakdown(results["breakdown"]))
    except ValueError as e:
        fail(str(e))
    finally:
        llm.shutdown()
    if save_json:
        report.save_json(save_json, "latency", {
            "model": engine_args.model, "batch_size": batch_size, "input_len": input_len,
            "output_len": output_len, "iters": iters, "warmup": warmup, "breakdown": breakdown,
            "sampling": {k: v for k, v in fields.items() if k != "structured_outputs"},
            "structured_regex": structured_regex, "seed": seed}, results)
    if plot:
        from parashift.bench.plots import latency_cdf

        latency_cdf(plot, latencies, f"batch {batch_size}: {input_len} in, {output_len} out")


bench_app.command()(serve)
bench_app.command()(sweep)

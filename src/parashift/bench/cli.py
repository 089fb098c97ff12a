"""`parashift bench throughput | latency | serve | sweep`: the project's measuring
instrument. Every command shows progress, takes --seed, --save-json FILE (settings, versions,
machine, results, per-request records) and --plot FILE.png, and prints a one-screen summary."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated

import typer

from parashift.cli_options import (
    DataParallel,
    Dtype,
    KvCacheMemory,
    MaxBatchedTokens,
    MaxModelLen,
    MaxNumSeqs,
    ModelArg,
    Strategy,
    TensorParallel,
    Threads,
    fail,
    make_engine_args,
    setup_logging,
)

bench_app = typer.Typer(no_args_is_help=True, help="Measure throughput, latency, serving.")

NumPrompts = Annotated[int, typer.Option("--num-prompts")]
InputLen = Annotated[int | None, typer.Option("--input-len")]
OutputLen = Annotated[int | None, typer.Option("--output-len")]
InputRange = Annotated[str | None, typer.Option("--input-len-range", help="A:B")]
OutputRange = Annotated[str | None, typer.Option("--output-len-range", help="A:B")]
Dataset = Annotated[str | None, typer.Option(
    help=".jsonl (prompt or prompt_len, output_len) or ShareGPT .json/.jsonl")]
Seed = Annotated[int, typer.Option(help="seeds the workload and the arrivals")]
SaveJson = Annotated[str | None, typer.Option("--save-json", help="write everything here")]
Plot = Annotated[str | None, typer.Option(help="write a PNG here")]


def _engine(model, dtype, strategy, dp, tp, max_model_len, max_num_seqs,
            max_num_batched_tokens, kv_cache_memory, threads):
    return make_engine_args(model, dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
                            16, kv_cache_memory, 0.9, True, threads, strategy, dp, tp, None,
                            False)


def _workload(num_prompts, input_len, output_len, input_range, output_range, dataset,
              seed, tokenizer, vocab_size):
    from parashift.bench.datasets import load_dataset, parse_range, random_requests

    if dataset is not None:
        if input_len or input_range:
            raise ValueError("--dataset sets the prompts: drop --input-len/--input-len-range")
        return load_dataset(dataset, num_prompts, tokenizer, vocab_size, seed, output_len)
    if input_len is not None and input_range is not None:
        raise ValueError("give --input-len or --input-len-range, not both")
    if output_len is not None and output_range is not None:
        raise ValueError("give --output-len or --output-len-range, not both")
    ins = parse_range(input_range, "--input-len-range") if input_range else (
        (input_len, input_len) if input_len else (128, 128))
    outs = parse_range(output_range, "--output-len-range") if output_range else (
        (output_len, output_len) if output_len else (128, 128))
    if min(ins + outs) < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    return random_requests(num_prompts, ins, outs, vocab_size, seed)


@bench_app.command()
def throughput(
    model: ModelArg = None,
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
    dtype: Dtype = "auto",
    strategy: Strategy = None,
    data_parallel_size: DataParallel = None,
    tensor_parallel_size: TensorParallel = None,
    max_model_len: MaxModelLen = None,
    max_num_seqs: MaxNumSeqs = 128,
    max_num_batched_tokens: MaxBatchedTokens = None,
    kv_cache_memory: KvCacheMemory = None,
    threads: Threads = None,
) -> None:
    """Offline throughput of the engine (every DP rank for dp > 1), optionally against
    transformers on the same requests."""
    setup_logging()
    from parashift.bench import report
    from parashift.bench.offline import run_throughput

    if baseline not in (None, "hf"):
        fail(f"--baseline {baseline!r}: the only baseline is hf")
    if hf_batch_size < 1:
        fail("--hf-batch-size must be >= 1")
    try:
        args = _engine(model, dtype, strategy, data_parallel_size, tensor_parallel_size,
                       max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory,
                       threads)
        config = args.create_config()
        requests = _workload(num_prompts, input_len, output_len, input_len_range,
                             output_len_range, dataset, seed, _tokenizer(config.model),
                             config.model.vocab_size)
    except ValueError as e:
        fail(str(e))
    tokens = sum(r.prompt_len + r.output_len for r in requests)
    out_tokens = sum(r.output_len for r in requests)
    typer.echo(f"{len(requests)} requests, {tokens} tokens ({out_tokens} output); "
               f"strategy {args.strategy_spec()}")
    elapsed = run_throughput(args, requests)
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
    settings = {"model": config.model.path, "strategy": str(args.strategy_spec()),
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
def latency(
    model: ModelArg = None,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 8,
    input_len: Annotated[int, typer.Option("--input-len")] = 32,
    output_len: Annotated[int, typer.Option("--output-len")] = 128,
    iters: Annotated[int, typer.Option(help="timed batches")] = 5,
    warmup: Annotated[int, typer.Option(help="untimed batches first")] = 1,
    seed: Seed = 0,
    save_json: SaveJson = None,
    plot: Plot = None,
    dtype: Dtype = "auto",
    strategy: Strategy = None,
    tensor_parallel_size: TensorParallel = None,
    max_model_len: MaxModelLen = None,
    kv_cache_memory: KvCacheMemory = None,
    threads: Threads = None,
) -> None:
    """End-to-end latency of one batch (prefill and every decode step)."""
    setup_logging()
    from parashift.bench import report
    from parashift.bench.metrics import distribution
    from parashift.bench.offline import run_latency

    for flag, value in (("--batch-size", batch_size), ("--input-len", input_len),
                        ("--output-len", output_len), ("--iters", iters)):
        if value < 1:
            fail(f"{flag} must be >= 1")
    if warmup < 0:
        fail("--warmup must be >= 0")
    try:
        args = _engine(model, dtype, strategy, None, tensor_parallel_size, max_model_len, 256,
                       None, kv_cache_memory, threads)
        args.seed = seed
        if args.strategy_spec().size("dp") > 1:
            raise ValueError("latency measures one engine: drop the dp axis")
        latencies = run_latency(args, batch_size, input_len, output_len, iters, warmup)
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
            "model": model, "batch_size": batch_size, "input_len": input_len,
            "output_len": output_len, "iters": iters, "warmup": warmup, "seed": seed}, results)
    if plot:
        from parashift.bench.plots import latency_cdf

        latency_cdf(plot, latencies, f"batch {batch_size}: {input_len} in, {output_len} out")


def _rates_list(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            rate = math.inf if part == "inf" else float(part)
        except ValueError:
            raise typer.BadParameter(f"{part!r} is not a rate (a number or inf)",
                                     param_hint="--request-rate") from None
        if rate <= 0:
            raise typer.BadParameter("rates must be > 0", param_hint="--request-rate")
        rates.append(rate)
    return rates


@bench_app.command()
def serve(
    base_url: Annotated[str, typer.Option("--base-url", help="e.g. http://127.0.0.1:8000")],
    model: Annotated[str | None, typer.Option(help="model name (default: the server's first)")
                     ] = None,
    num_prompts: NumPrompts = 100,
    request_rate: Annotated[str, typer.Option(
        "--request-rate", help="requests/s, inf, or a list like 1,2,4,inf (a sweep)")] = "inf",
    burstiness: Annotated[float, typer.Option(help="1: Poisson; <1 burstier")] = 1.0,
    max_concurrency: Annotated[int | None, typer.Option("--max-concurrency")] = None,
    input_len: InputLen = None,
    output_len: OutputLen = None,
    input_len_range: InputRange = None,
    output_len_range: OutputRange = None,
    dataset: Dataset = None,
    tokenizer: Annotated[str | None, typer.Option(
        help="for text datasets (default: the embedded SmolLM2's)")] = None,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="random prompt ids below")
                          ] = 32000,
    goodput: Annotated[list[str] | None, typer.Option(help="SLO, e.g. ttft:500 tpot:50")
                       ] = None,
    api_key: Annotated[str | None, typer.Option("--api-key")] = None,
    seed: Seed = 0,
    save_json: SaveJson = None,
    plot: Plot = None,
) -> None:
    """Streaming load against any OpenAI-compatible /v1/completions server."""
    _serve(base_url, model, num_prompts, _rates_list(request_rate), burstiness,
           max_concurrency, input_len, output_len, input_len_range, output_len_range, dataset,
           tokenizer, vocab_size, goodput, api_key, seed, save_json, plot)


@bench_app.command()
def sweep(
    base_url: Annotated[str, typer.Option("--base-url")],
    request_rates: Annotated[str, typer.Option("--request-rates")] = "1,2,4,inf",
    model: Annotated[str | None, typer.Option()] = None,
    num_prompts: NumPrompts = 100,
    max_concurrency: Annotated[int | None, typer.Option("--max-concurrency")] = None,
    input_len: InputLen = None,
    output_len: OutputLen = None,
    dataset: Dataset = None,
    vocab_size: Annotated[int, typer.Option("--vocab-size")] = 32000,
    goodput: Annotated[list[str] | None, typer.Option()] = None,
    seed: Seed = 0,
    save_json: SaveJson = None,
    plot: Plot = None,
) -> None:
    """`serve` at several request rates; the plot is throughput against p99 latency."""
    _serve(base_url, model, num_prompts, _rates_list(request_rates), 1.0, max_concurrency,
           input_len, output_len, None, None, dataset, None, vocab_size, goodput, None, seed,
           save_json, plot)


def _serve(base_url, model, num_prompts, rates, burstiness, max_concurrency, input_len,
           output_len, input_range, output_range, dataset, tokenizer, vocab_size, goodput,
           api_key, seed, save_json, plot) -> None:
    setup_logging()
    from tqdm import tqdm

    from parashift.bench import report
    from parashift.bench.metrics import parse_goodput, summarize
    from parashift.bench.serve_client import run_load

    if max_concurrency is not None and max_concurrency < 1:
        fail("--max-concurrency must be >= 1")
    if burstiness <= 0:
        fail("--burstiness must be > 0")
    try:
        slos = parse_goodput(goodput or [])
        tok = None
        if dataset is not None:
            from transformers import AutoTokenizer

            from parashift.models.loader import resolve_model_path

            tok = AutoTokenizer.from_pretrained(tokenizer or resolve_model_path(None))
        requests = _workload(num_prompts, input_len, output_len, input_range, output_range,
                             dataset, seed, tok, vocab_size)
    except ValueError as e:
        fail(str(e))
    runs, summaries = {}, {}
    for rate in rates:
        label = "inf" if math.isinf(rate) else f"{rate:g}"
        bar = tqdm(total=len(requests), desc=f"rate {label}", unit="req")
        try:
            records, duration = asyncio.run(run_load(
                base_url, model, requests, rate, burstiness, max_concurrency, seed, api_key,
                on_done=lambda _, bar=bar: bar.update()))
        except OSError as e:  # nothing listening, bad host
            fail(f"--base-url {base_url}: {e}")
        finally:
            bar.close()
        runs[label] = records
        summaries[label] = summarize(records, duration, slos or None)
        typer.echo(report.format_serve(summaries[label], f"request rate {label}"))
    settings = {"base_url": base_url, "model": model, "num_prompts": len(requests),
                "request_rates": list(runs), "burstiness": burstiness,
                "max_concurrency": max_concurrency, "dataset": dataset, "seed": seed,
                "goodput_slos_ms": slos}
    if save_json:
        report.save_json(save_json, "serve", settings,
                         summaries if len(runs) > 1 else next(iter(summaries.values())),
                         [{"rate": label, **_record_dict(r)} for label, records in runs.items()
                          for r in records])
    if plot:
        from parashift.bench import plots

        if len(runs) > 1:  # the sweep at `plot`, every rate's CDFs beside it
            plots.sweep(plot, [(label, s["output_throughput"], s["ttft_ms"].get("p99", 0.0),
                                s["e2e_ms"].get("p99", 0.0)) for label, s in summaries.items()],
                        f"{base_url}: throughput vs p99 latency")
            stem, dot, ext = plot.rpartition(".")
            cdfs = f"{stem}-cdf.{ext}" if dot else f"{plot}-cdf"
            plots.serve_cdfs(cdfs, runs, f"{base_url}, latency by request rate")
            typer.echo(f"plots: {plot}, {cdfs}")
        else:
            plots.serve_cdfs(plot, runs, f"{base_url}, rate {next(iter(runs))}")


def _record_dict(record) -> dict:
    import dataclasses

    return {**dataclasses.asdict(record), "tpot": record.tpot}

"""`parashift bench serve` and `sweep`: load against a running OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Annotated

import typer

from parashift.bench.options import (
    Dataset,
    InputLen,
    InputRange,
    MultiTurnHistoryLen,
    MultiTurnQuestionLen,
    MultiTurnRounds,
    MultiTurnSystemLen,
    MultiTurnUsers,
    NumPrompts,
    OutputLen,
    OutputRange,
    Plot,
    Sampling,
    SaveJson,
    Seed,
    sampling_fields,
    workload,
)
from parashift.cli_options import fail, setup_logging


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
    multi_turn_users: MultiTurnUsers = 8,
    multi_turn_rounds: MultiTurnRounds = 4,
    multi_turn_system_len: MultiTurnSystemLen = 1000,
    multi_turn_question_len: MultiTurnQuestionLen = 100,
    multi_turn_history_len: MultiTurnHistoryLen = 0,
    tokenizer: Annotated[str | None, typer.Option(
        help="for text datasets (default: the embedded SmolLM2's)")] = None,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="random prompt ids below")
                          ] = 32000,
    goodput: Annotated[list[str] | None, typer.Option(help="SLO, e.g. ttft:500 tpot:50")
                       ] = None,
    api_key: Annotated[str | None, typer.Option("--api-key")] = None,
    sampling: Sampling = "",
    seed: Seed = 0,
    save_json: SaveJson = None,
    plot: Plot = None,
) -> None:
    """Streaming load against any OpenAI-compatible /v1/completions server."""
    rates = _rates_list(request_rate)
    setup_logging()
    from tqdm import tqdm

    from parashift.bench import multi_turn, report
    from parashift.bench.expert_load import expert_load, format_load, scrape
    from parashift.bench.metrics import parse_goodput, summarize
    from parashift.bench.serve_client import run_load

    if max_concurrency is not None and max_concurrency < 1:
        fail("--max-concurrency must be >= 1")
    if burstiness <= 0:
        fail("--burstiness must be > 0")
    try:
        fields = sampling_fields(sampling)
        slos = parse_goodput(goodput or [])
        tok, sizes, follows, tags = None, None, None, None
        if dataset == multi_turn.NAME:
            if input_len or input_len_range or output_len_range:
                raise ValueError("--dataset multi-turn sets the prompts: drop --input-len, "
                                 "--input-len-range and --output-len-range (its sizes: "
                                 "--multi-turn-*, --output-len)")
            sizes = multi_turn.MultiTurnSizes(multi_turn_users, multi_turn_rounds,
                                              multi_turn_system_len, multi_turn_question_len,
                                              output_len or 128, multi_turn_history_len)
        elif dataset is not None:
            from transformers import AutoTokenizer

            from parashift.models.loader import resolve_model_path

            tok = AutoTokenizer.from_pretrained(tokenizer or resolve_model_path(None))  # nosec B615
        if sizes is None:
            requests = workload(num_prompts, input_len, output_len, input_len_range,
                                output_len_range, dataset, seed, tok, vocab_size)
    except ValueError as e:
        fail(str(e))
    runs, summaries = {}, {}
    for k, rate in enumerate(rates):
        label = "inf" if math.isinf(rate) else f"{rate:g}"
        if sizes is not None:  # new conversations at each rate: none finds the last's cached
            conversations = multi_turn.load(sizes, vocab_size, seed + k)
            requests, follows = conversations.requests, conversations.follows
            tags = [{"user": u, "round": r + 1}
                    for u, r in zip(conversations.users, conversations.rounds, strict=True)]
        experts_before = scrape(base_url, api_key)
        bar = tqdm(total=len(requests), desc=f"rate {label}", unit="req")
        try:
            records, duration = asyncio.run(run_load(
                base_url, model, requests, rate, burstiness, max_concurrency, seed, api_key,
                on_done=lambda _, bar=bar: bar.update(), sampling=fields, follows=follows))
        except OSError as e:  # nothing listening, bad host
            fail(f"--base-url {base_url}: {e}")
        finally:
            bar.close()
        runs[label] = records
        summaries[label] = summarize(records, duration, slos or None)
        text = report.format_serve(summaries[label], f"request rate {label}")
        if load := expert_load(experts_before, scrape(base_url, api_key)):
            summaries[label]["expert_load"] = load
            text += "\n" + format_load(load)
        if sizes is not None:
            summaries[label]["rounds"] = multi_turn.per_round(records, conversations.rounds)
            text += "\n" + multi_turn.format_rounds(summaries[label]["rounds"])
        typer.echo(text)
    settings = {"base_url": base_url, "model": model, "num_prompts": len(requests),
                "request_rates": list(runs), "burstiness": burstiness,
                "max_concurrency": max_concurrency, "dataset": dataset, "seed": seed,
                "sampling": fields,
                "multi_turn": dataclasses.asdict(sizes) if sizes is not None else None,
                "goodput_slos_ms": slos}
    if save_json:
        report.save_json(save_json, "serve", settings,
                         summaries if len(runs) > 1 else next(iter(summaries.values())),
                         [{"rate": label, **(tags[i] if tags else {}), **_record_dict(r)}
                          for label, records in runs.items() for i, r in enumerate(records)])
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
    serve(base_url, model, num_prompts, request_rates, max_concurrency=max_concurrency,
          input_len=input_len, output_len=output_len, dataset=dataset, vocab_size=vocab_size,
          goodput=goodput, seed=seed, save_json=save_json, plot=plot)


def _record_dict(record) -> dict:
    return {**dataclasses.asdict(record), "tpot": record.tpot}

"""`parashift bench throughput`: offline throughput of the engine, optionally against
transformers on the same requests in the same run, and as a fraction of the best GEMM rate of
this device (--roofline)."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from parashift.bench.options import (
    Dataset,
    InputLen,
    InputRange,
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
from parashift.cli_options import engine_options, fail, setup_logging

if TYPE_CHECKING:
    from parashift.engine.args import EngineArgs


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
    hf_batch_size: Annotated[int, typer.Option("--hf-batch-size",
                                               help="requests per static HF batch")] = 32,
    hf_dtype: Annotated[Literal["bfloat16", "float16", "float32"] | None, typer.Option(
        "--hf-dtype", help="dtype of the transformers baseline (default: the engine's)")
                        ] = None,
    repeat: Annotated[int, typer.Option(help="timed runs per system; rates from the median")
                      ] = 1,
    roofline: Annotated[bool, typer.Option(
        "--roofline", help="also time the model's GEMM shapes: fraction of the best rate")
                        ] = False,
    sampling: Sampling = "",
    seed: Seed = 0,
    save_json: SaveJson = None,
    plot: Plot = None,
) -> None:
    """Offline throughput of the engine (every DP rank for dp > 1), optionally against
    transformers on the same requests."""
    setup_logging()
    from parashift.bench import report
    from parashift.bench.offline import run_throughput
    from parashift.engine.args import create_config

    if baseline not in (None, "hf"):
        fail(f"--baseline {baseline!r}: the only baseline is hf")
    if hf_batch_size < 1:
        fail("--hf-batch-size must be >= 1")
    if repeat < 1:
        fail("--repeat must be >= 1")
    if hf_dtype is not None and baseline != "hf":
        fail("--hf-dtype sets the transformers baseline's dtype: add --baseline hf")
    try:
        fields = sampling_fields(sampling)
        config = create_config(engine_args)  # once: every step below reads it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer_path)  # nosec B615
        requests = workload(num_prompts, input_len, output_len, input_len_range,
                            output_len_range, dataset, seed, tokenizer, config.model.vocab_size)
    except ValueError as e:
        fail(str(e))
    tokens = sum(r.prompt_len + r.output_len for r in requests)
    out_tokens = sum(r.output_len for r in requests)
    typer.echo(f"{len(requests)} requests, {tokens} tokens ({out_tokens} output); "
               f"strategy {config.parallel.strategy}; dtype "
               f"{str(config.model.dtype).removeprefix('torch.')}")
    engine = run_throughput(engine_args, config, requests, repeat=repeat, sampling=fields)
    rates = {"parashift": _rates(engine.elapsed_s, len(requests), tokens, out_tokens)}
    results: dict[str, Any] = {}
    labels = {"parashift": "parashift"}
    if baseline == "hf":
        import torch

        from parashift.bench.hf_baseline import run_hf
        from parashift.bench.metrics import prefix_agreement

        dtype = getattr(torch, hf_dtype) if hf_dtype else config.model.dtype
        hf_times, hf_ids = run_hf(config.model.path, requests, dtype,
                                  config.device.torch_device, hf_batch_size, repeat=repeat)
        rates["hf"] = _rates(hf_times, len(requests), tokens, out_tokens)
        labels["hf"] = f"hf {str(dtype).removeprefix('torch.')} bs{hf_batch_size}"
        results["speedup_over_hf"] = (rates["parashift"]["total_tokens_per_s"]
                                      / rates["hf"]["total_tokens_per_s"])
        if engine.token_ids is not None:  # dp > 1 keeps its outputs in the ranks
            results["greedy_prefix_agreement"] = prefix_agreement(engine.token_ids, hf_ids)
    if roofline:
        from parashift.bench.roofline import count_params, measure_roofline, model_gflops

        hf_config = config.model.hf_config
        typer.echo("roofline GEMMs ...")
        results["roofline"] = measure_roofline(config.device.torch_device,
                                               hf_config.hidden_size,
                                               hf_config.intermediate_size)
        results["num_params"] = count_params(hf_config)
        for r in rates.values():
            r["model_gflops"] = model_gflops(results["num_params"], r["total_tokens_per_s"])
            r["fraction_of_roofline"] = r["model_gflops"] / results["roofline"]["best_gflops"]
    typer.echo(_table(rates, labels, repeat > 1, results))
    results = {**rates, **results}
    settings = {"model": config.model.path, "strategy": str(config.parallel.strategy),
                "dtype": str(config.model.dtype), "num_prompts": len(requests),
                "input_len": input_len, "output_len": output_len,
                "input_len_range": input_len_range, "output_len_range": output_len_range,
                "dataset": dataset, "seed": seed, "baseline": baseline,
                "hf_batch_size": hf_batch_size, "hf_dtype": hf_dtype, "repeat": repeat,
                "roofline": roofline, "sampling": fields}
    if save_json:
        report.save_json(save_json, "throughput", settings, results, requests)
    if plot:
        from parashift.bench.plots import throughput_bars

        throughput_bars(plot, {n: r["total_tokens_per_s"] for n, r in rates.items()},
                        f"throughput, {len(requests)} requests")


def _rates(times: list[float], n: int, tokens: int, out_tokens: int) -> dict[str, Any]:
    median = statistics.median(times)
    return {"elapsed_s": times, "elapsed_min_s": min(times), "elapsed_median_s": median,
            "requests_per_s": n / median, "total_tokens_per_s": tokens / median,
            "output_tokens_per_s": out_tokens / median}


def _table(rates: dict[str, dict], labels: dict[str, str], with_min: bool,
           results: dict[str, Any]) -> str:
    roof = results.get("roofline")
    head = f"{'':22}" + (f"{'min s':>9}{'median s':>10}" if with_min else f"{'seconds':>10}")
    head += f"{'requests/s':>12}{'total tok/s':>13}{'output tok/s':>14}"
    lines = [head + (f"{'GFLOP/s':>9}{'roofline':>10}" if roof else "")]
    for name, r in rates.items():
        line = f"{labels[name]:22}" + (f"{r['elapsed_min_s']:>9.3f}{r['elapsed_median_s']:>10.3f}"
                                       if with_min else f"{r['elapsed_median_s']:>10.2f}")
        line += (f"{r['requests_per_s']:>12.2f}"
                 f"{r['total_tokens_per_s']:>13.1f}{r['output_tokens_per_s']:>14.1f}")
        if roof:
            line += f"{r['model_gflops']:>9.1f}{100 * r['fraction_of_roofline']:>9.1f}%"
        lines.append(line)
    if "speedup_over_hf" in results:
        line = f"parashift / hf: {results['speedup_over_hf']:.2f}x"
        if "greedy_prefix_agreement" in results:
            line += (f"; greedy outputs agree on {100 * results['greedy_prefix_agreement']:.1f}%"
                     " of tokens (common prefix)")
        lines.append(line)
    if roof:
        b = roof["best"]
        lines.append(f"roofline: {roof['best_gflops']:.1f} GFLOP/s ({b['path']} GEMM "
                     f"{b['M']}x{b['K']}x{b['N']}); model {results['num_params'] / 1e6:.1f} M "
                     "parameters")
    return "\n".join(lines)


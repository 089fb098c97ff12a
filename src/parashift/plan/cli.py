"""`parashift plan`: where every rank goes, whether it fits, what each step communicates, and
(--auto) which strategy to use -- before anything is loaded or launched."""

from __future__ import annotations

import json
import os
from typing import Annotated, Literal

import typer

from parashift.cli_options import fail, parse_counts, parse_size
from parashift.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_SEQS,
    DTYPE_ALIASES,
    DTYPE_BYTES,
    DTYPE_CHOICES,
    QUANTIZATIONS,
    resolve_dtype_name,
)


def load_shape(model: str | None):
    """A preset name, a HF folder, a bare config.json, or a .gguf (converted once, cached)."""
    from types import SimpleNamespace

    from parashift.plan.presets import PRESETS, find_preset
    from parashift.plan.shape import from_hf_config

    if model is not None and (preset := find_preset(model)) is not None:
        return preset
    if model is not None and not os.path.exists(model):
        raise ValueError(f"MODEL {model!r} is neither a path nor a preset; presets: "
                         + ", ".join(PRESETS))
    if model is None or model.endswith(".gguf"):
        from parashift.models.loader import resolve_model_path

        folder = resolve_model_path(model)
        config_path = os.path.join(folder, "config.json")
    else:
        config_path = model if os.path.isfile(model) else os.path.join(model, "config.json")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"MODEL {model}: cannot read {config_path} ({e})") from None
    name = os.path.basename(os.path.dirname(os.path.abspath(config_path))) if model else (
        "SmolLM2-135M-Instruct")
    try:
        return from_hf_config(SimpleNamespace(**raw), name)
    except AttributeError as e:
        raise ValueError(f"MODEL {model}: {config_path} lacks a field ({e})") from None


Objective = Annotated[Literal["throughput", "latency"], typer.Option(
    help="what --auto (plan) or --strategy auto (run, generate) ranks by")]


def plan(
    model: Annotated[str | None, typer.Argument(
        help="preset (e.g. Llama-3.1-70B), HF folder, config.json or .gguf; default: SmolLM2")
    ] = None,
    strategy: Annotated[str | None, typer.Option(help="e.g. dp4xtp2 (default: dp over all)")
                        ] = None,
    devices: Annotated[int | None, typer.Option(help="devices in all (default: the strategy's)")
                       ] = None,
    device: Annotated[str, typer.Option(help="h100-80g | h200-141g | a100-80g | l40s-48g | cpu")
                      ] = "cpu",
    device_memory: Annotated[str | None, typer.Option("--device-memory", help="e.g. 80GiB")
                             ] = None,
    nodes: int = 1,
    intra_node: Annotated[str | None, typer.Option("--intra-node", help="nvlink | pcie | shm")
                          ] = None,
    inter_node: Annotated[str, typer.Option("--inter-node", help="ib | ethernet")] = "ib",
    pp_layer_partition: Annotated[str | None, typer.Option(
        "--pp-layer-partition", help="layers per pipeline stage, e.g. 10,10,10")] = None,
    concurrency: Annotated[str, typer.Option(
        help="running requests to estimate the pipeline bubble at, e.g. 1,4,32")] = "1,4,32",
    prompt_len: Annotated[int, typer.Option(
        "--prompt-len", help="the prompt of the prefill bubble estimate's requests")] = 512,
    output_len: Annotated[int, typer.Option(
        "--output-len", help="their output tokens (1: prefill only)")] = 1,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len")] = None,
    dtype: Annotated[Literal[(*DTYPE_CHOICES, *DTYPE_ALIASES, "fp8")], typer.Option(
        help="auto: the engine's choice for this checkpoint and device")] = "auto",
    quantization: Annotated[Literal[QUANTIZATIONS] | None, typer.Option(
        "--quantization", "-q", help="CPU: the decoder layers' projections weight-only int8 "
        "or int4, as `run -q` loads them")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option("--gpu-memory-utilization")
                                      ] = DEFAULT_GPU_MEMORY_UTILIZATION,
    kv_cache_memory: Annotated[str | None, typer.Option(
        "--kv-cache-memory", help="CPU: the KV budget per worker, e.g. 2GiB")] = None,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs")] = DEFAULT_MAX_NUM_SEQS,
    block_size: Annotated[int, typer.Option("--block-size")] = DEFAULT_BLOCK_SIZE,
    auto: Annotated[bool, typer.Option(help="rank every strategy for these devices")] = False,
    objective: Objective = "throughput",
    slo_tpot_ms: Annotated[float | None, typer.Option("--slo-tpot-ms")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON document")] = False,
    backend: Annotated[str, typer.Option(help="ray: where each rank would go on the cluster")
                       ] = "mp",
    ray_address: Annotated[str | None, typer.Option("--ray-address")] = None,
) -> None:
    """Dry-run a topology: mesh, memory, KV capacity, communication, estimates."""
    from rich.console import Console

    from parashift.plan import report
    from parashift.plan.auto import rank_plans
    from parashift.plan.estimate import PlanSettings, keeps_shared_weight_copies, make_plan
    from parashift.plan.hardware import DEVICES, INTER_NODE, INTRA_NODE
    from parashift.strategies.pipeline import parse_partition
    from parashift.strategies.spec import StrategySpec

    if device not in DEVICES:
        fail(f"--device {device!r}: known devices are {', '.join(DEVICES)}")
    if intra_node is not None and intra_node not in INTRA_NODE:
        fail(f"--intra-node {intra_node!r}: use {' | '.join(INTRA_NODE)}")
    if inter_node not in INTER_NODE:
        fail(f"--inter-node {inter_node!r}: use {' | '.join(INTER_NODE)}")
    if nodes < 1:
        fail("--nodes must be >= 1")
    if quantization is not None and DEVICES[device].is_gpu:
        fail(f"--quantization {quantization} runs on --device cpu, not on {device}")
    if prompt_len < 1:
        fail("--prompt-len must be >= 1")
    if output_len < 1:
        fail("--output-len must be >= 1")
    levels = tuple(parse_counts(concurrency, "--concurrency"))
    if not 0 < gpu_memory_utilization <= 1:
        fail("--gpu-memory-utilization must be in (0, 1]")
    try:
        shape = load_shape(model)
        spec = StrategySpec.parse(strategy) if strategy else None
        if pp_layer_partition is not None:
            spec = (spec or StrategySpec.from_sizes()).with_options(
                "pp", partition=parse_partition(pp_layer_partition))
        n = devices if devices is not None else (spec.world_size if spec else 1)
        if n < 1:
            raise ValueError(f"--devices {n}: need at least one device")
        if nodes > n:
            raise ValueError(f"--nodes {nodes} is more than --devices {n}")
        spec = spec or StrategySpec.from_sizes(dp=n)
        # The engine's dtype rule and table (defaults.py), on the checkpoint's dtype.
        dtype_name = "fp8" if dtype == "fp8" else resolve_dtype_name(
            dtype, shape.checkpoint_dtype, "cuda" if DEVICES[device].is_gpu else "cpu")
        dtype_bytes = 1 if dtype == "fp8" else DTYPE_BYTES[dtype_name]
        settings = PlanSettings(
            DEVICES[device], n, nodes, INTRA_NODE.get(intra_node or ""), INTER_NODE[inter_node],
            max_model_len, dtype_bytes, gpu_memory_utilization,
            parse_size(kv_cache_memory, "--kv-cache-memory") if kv_cache_memory else None,
            parse_size(device_memory, "--device-memory") if device_memory else None,
            block_size, max_num_seqs,
            # CPU: this machine's cores, as `parashift run` would place the ranks on them
            cpu_ids=None if DEVICES[device].is_gpu else tuple(sorted(os.sched_getaffinity(0))),
            concurrency=levels, prompt_len=prompt_len, output_len=output_len,
            quantization=quantization,
            shared_weight_copies=keeps_shared_weight_copies(DEVICES[device].is_gpu,
                                                            dtype_name))
    except (ValueError, typer.BadParameter) as e:
        fail(str(e))
    console = Console()
    if auto:
        plans, why = rank_plans(shape, settings, objective, slo_tpot_ms)
        if as_json:
            typer.echo(json.dumps({"winner": why, "ranking": [
                report.to_json(p, settings) for p in plans]}, indent=2))
        else:
            report.show_ranking(plans, why, console) if plans else console.print(why)
        return
    if spec.world_size > n:
        fail(f"strategy {spec} needs {spec.world_size} devices; --devices is {n}")
    result = make_plan(shape, spec, settings)
    doc = report.to_json(result, settings)
    if backend == "ray":
        doc["ray_placement"] = _ray_placement(spec, settings, ray_address, console, as_json)
    elif backend != "mp":
        fail(f"--backend {backend!r}: use mp or ray")
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        report.show(result, settings, console)
    if not result.fits:
        raise typer.Exit(1)


def _ray_placement(spec, settings, address, console, quiet: bool) -> list[dict]:
    """Where `parashift run --backend ray` would put each rank on the connected cluster."""
    import dataclasses

    from rich.table import Table

    from parashift.runtime.ray_cluster import rank_bundles
    from parashift.runtime.ray_nodes import cluster_nodes, place

    try:
        nodes = cluster_nodes(address)
    except ConnectionError as e:
        fail(f"--ray-address {address or 'auto'}: {e}")
    processes = spec.processes()
    bundles = rank_bundles(processes, settings.device.is_gpu)
    placements = place(nodes, bundles, processes.num_engines)
    if not quiet:
        table = Table(title=f"Ray placement ({len(nodes)} node(s))")
        for col in ("dp rank", "node", "bundles"):
            table.add_column(col)
        for p in placements:
            table.add_row(str(p.rank), p.node or "[red]no node has room[/]", str(p.bundles))
        console.print(table)
    return [dataclasses.asdict(p) for p in placements]

"""`parashift plan`: where every rank goes, whether it fits, what each step communicates, and
(--auto) which strategy to use -- before anything is loaded or launched. The engine's flags are
`run`'s own (cli_options.py); the flags below describe the hardware and the workload."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from parashift.cli_options import engine_options, fail, parse_counts
from parashift.defaults import DTYPE_ALIASES, DTYPE_CHOICES

if TYPE_CHECKING:
    from rich.console import Console

    from parashift.engine.args import EngineArgs
    from parashift.plan.estimate import PlanSettings
    from parashift.plan.shape import ModelShape
    from parashift.strategies.spec import StrategySpec

# The engine flags a dry run reads (the others would not change the plan).
ENGINE_FLAGS = ("strategy", "data_parallel_size", "tensor_parallel_size",
                "pipeline_parallel_size", "pp_layer_partition", "enable_expert_parallel",
                "dtype", "quantization", "max_model_len", "max_num_seqs",
                "max_num_batched_tokens", "block_size", "kv_cache_memory",
                "gpu_memory_utilization", "cpu_kernels", "gemm_paths", "kv_offloading_size",
                "kv_disk_dir", "kv_disk_size")
ModelOrPreset = Annotated[str | None, typer.Argument(
    help="preset (e.g. Llama-3.1-70B), HF folder, config.json or .gguf; default: SmolLM2")]
DtypeOption = Annotated[Literal[(*DTYPE_CHOICES, *DTYPE_ALIASES, "fp8")], typer.Option(
    help="the weights' dtype (auto: the engine's choice for the checkpoint and device; fp8: "
         "plan only, what fp8 weights would take)")]
Objective = Annotated[Literal["throughput", "latency"], typer.Option(
    help="what --auto (plan) or --strategy auto (run, generate) ranks by")]


@engine_options(flags=ENGINE_FLAGS, replace={"model": ModelOrPreset, "dtype": DtypeOption})
def plan(
    engine_args: EngineArgs,
    devices: Annotated[int | None, typer.Option(
        help="devices in all (default: the strategy's; without one, dp over all)")] = None,
    device: Annotated[str, typer.Option(
        help="h100-80g | h200-141g | a100-80g | l40s-48g | cpu")] = "cpu",
    device_memory: Annotated[str | None, typer.Option(help="e.g. 80GiB")] = None,
    nodes: int = 1,
    intra_node: Annotated[str | None, typer.Option(help="nvlink | pcie | shm")] = None,
    inter_node: Annotated[str, typer.Option(help="ib | ethernet")] = "ib",
    concurrency: Annotated[str, typer.Option(
        help="running requests to estimate the pipeline bubble at, e.g. 1,4,32")] = "1,4,32",
    prompt_len: Annotated[int, typer.Option(
        help="the prompt of the prefill bubble estimate's requests")] = 512,
    output_len: Annotated[int, typer.Option(help="their output tokens (1: prefill only)")] = 1,
    auto: Annotated[bool, typer.Option(help="rank every strategy for these devices")] = False,
    objective: Objective = "throughput",
    slo_tpot_ms: Annotated[float | None, typer.Option("--slo-tpot-ms")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON document")] = False,
    backend: Annotated[str, typer.Option(
        help="ray: where each rank would go on the cluster")] = "mp",
    ray_address: Annotated[str | None, typer.Option("--ray-address")] = None,
) -> None:
    """Dry-run a topology: mesh, memory, KV capacity, communication, estimates."""
    from parashift.plan.load_shape import load_shape
    from parashift.plan.settings import Hardware, Workload, dry_run_settings, layout

    levels = tuple(parse_counts(concurrency, "--concurrency"))
    try:
        hardware = Hardware.from_flags(device, nodes, intra_node, inter_node, device_memory)
        workload = Workload(levels, prompt_len, output_len)
        shape = load_shape(engine_args.model)
        spec, num_devices = layout(engine_args, devices, nodes)
        settings = dry_run_settings(engine_args, shape, hardware, num_devices, workload)
    except (ValueError, typer.BadParameter) as e:
        fail(str(e))
    if auto:
        show_ranking(shape, settings, objective, slo_tpot_ms, as_json)
    else:
        show_plan(shape, spec, settings, as_json, backend, ray_address)


def show_ranking(shape: ModelShape, settings: PlanSettings, objective: str,
                 slo_tpot_ms: float | None, as_json: bool) -> None:
    """--auto: every strategy these devices allow that fits, best first, and why."""
    from rich.console import Console

    from parashift.plan import report
    from parashift.plan.auto import rank_plans

    plans, why = rank_plans(shape, settings, objective, slo_tpot_ms)
    if as_json:
        typer.echo(json.dumps({"winner": why, "ranking": [
            report.to_json(p, settings) for p in plans]}, indent=2))
    elif plans:
        report.show_ranking(plans, why, Console())
    else:
        Console().print(why)


def show_plan(shape: ModelShape, spec: StrategySpec, settings: PlanSettings, as_json: bool,
              backend: str, ray_address: str | None) -> None:
    """One strategy's plan (exit 1 where it does not fit), with --backend ray where each rank
    would go on the cluster."""
    from rich.console import Console

    from parashift.plan import report
    from parashift.plan.estimate import make_plan

    if spec.world_size > settings.devices:
        fail(f"strategy {spec} needs {spec.world_size} devices; --devices is "
             f"{settings.devices}")
    result = make_plan(shape, spec, settings)
    doc = report.to_json(result, settings)
    console = Console()
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


def _ray_placement(spec: StrategySpec, settings: PlanSettings, address: str | None,
                   console: Console, quiet: bool) -> list[dict]:
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

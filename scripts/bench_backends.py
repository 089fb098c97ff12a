"""`python scripts/bench_backends.py`: start-up time (the command to its "is serving" line) and
serving throughput of `parashift run` with the mp and Ray backends, alternating round by round
so that a noisy machine hits both alike. Without RAY_ADDRESS / --ray-address in --server-args
the launcher starts a local Ray cluster sized for the strategy."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer
from study_options import ServerArgs, served_workload

from parashift.bench.options import NumPrompts, SaveJson, Seed
from parashift.cli_options import ModelArg, fail, setup_logging

# Ray would otherwise ask to report usage, and refuse a local cluster on macOS.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
SHOWN = ("Duration", "Output token", "Total token")  # the lines of the serve summary printed


def backends(
    model: ModelArg = None,
    rounds: Annotated[int, typer.Option(help="rounds, each starting every backend once")] = 2,
    strategy: Annotated[str, typer.Option(help="the servers' parallel layout")] = "dp2",
    names: Annotated[str, typer.Option("--backends", help="comma-separated: mp, ray")
                     ] = "mp,ray",
    num_prompts: NumPrompts = 32,
    input_len: Annotated[int, typer.Option("--input-len")] = 64,
    output_len: Annotated[int, typer.Option("--output-len")] = 128,
    extra: ServerArgs = "",
    seed: Seed = 0,
    save_json: SaveJson = None,
) -> None:
    """Start-up and throughput of `parashift run --backend mp|ray`, alternating."""
    setup_logging()
    from study_server import running_server, send_all

    from parashift.bench import report
    from parashift.bench.metrics import summarize

    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in ("mp", "ray")]
    if unknown or not chosen:
        fail(f"--backends {names!r}: choose from mp, ray")
    for flag, value in (("--rounds", rounds), ("--num-prompts", num_prompts),
                        ("--input-len", input_len), ("--output-len", output_len)):
        if value < 1:
            fail(f"{flag} must be >= 1")
    requests, _, extra_args = served_workload(model, num_prompts, f"{input_len}:{input_len}",
                                              f"{output_len}:{output_len}", seed, extra)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    try:
        for round_ in range(rounds):
            for name in chosen:
                flags = ["--strategy", strategy, "--backend", name, *extra_args]
                with running_server(model, flags, env=RAY_ENV) as server:
                    typer.echo(f"round {round_ + 1} {name}: start-up {server.startup_s:.1f} s")
                    duration, records = send_all(server.url, requests)
                summary = summarize(records, duration)
                for line in report.format_serve(summary, name).splitlines():
                    if line.startswith(SHOWN):
                        typer.echo(line)
                runs[name].append({"startup_s": server.startup_s, **summary,
                                   "requests": [dataclasses.asdict(r) for r in records]})
    except RuntimeError as e:
        fail(str(e))
    typer.echo(f"{'backend':10}{'start-up s':>20}{'output tok/s':>24}{'total tok/s':>24}")
    for name, rs in runs.items():
        typer.echo(f"{name:10}{_joined(rs, 'startup_s'):>20}"
                   f"{_joined(rs, 'output_throughput'):>24}"
                   f"{_joined(rs, 'total_token_throughput'):>24}")
    if save_json:
        report.save_json(save_json, "backends", {
            "model": model, "rounds": rounds, "strategy": strategy, "backends": chosen,
            "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
            "server_args": extra, "seed": seed}, runs)


def _joined(runs: list[dict[str, Any]], key: str) -> str:
    """One value per round: "16.9, 17.1"."""
    return ", ".join(f"{r[key]:.1f}" for r in runs)


if __name__ == "__main__":
    typer.run(backends)

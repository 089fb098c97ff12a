"""The `python scripts/soak.py` command: starts the server, runs the soak (scripts/soak_run.py),
prints what happened and exits non-zero when a promise broke."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Annotated

import typer

from parashift.bench.options import SaveJson, Seed
from parashift.cli_options import ModelArg, fail, setup_logging


def soak(
    model: ModelArg = None,
    num_requests: Annotated[int, typer.Option("--num-requests")] = 5000,
    concurrency: Annotated[int, typer.Option(help="requests in flight")] = 32,
    kill: Annotated[bool, typer.Option(
        "--kill/--no-kill", help="SIGKILL engine dp1 part-way (it restarts)")] = True,
    seed: Seed = 0,
    save_json: SaveJson = None,
) -> None:
    """A long mixed run on dp2 behind two API servers, with bad requests, clients that leave
    mid-stream and an engine killed: every good request must succeed, nothing may leak.
    MODEL: default a random-weight Llama (hidden 256, 4 layers) with SmolLM2's tokenizer and
    its whole vocabulary (chat text tokenizes to any of its ids)."""
    setup_logging()
    from random_model import random_llama
    from soak_requests import plan
    from soak_run import SERVER_ARGS, run_soak
    from study_server import running_server

    from parashift.bench import report
    from parashift.models.loader import load_hf_config, resolve_model_path

    if num_requests < 1 or concurrency < 1:
        fail("--num-requests and --concurrency must be >= 1")
    folder = model or random_llama(hidden=256, intermediate=512, layers=4, heads=4,
                                   kv_heads=2, vocab=49152)
    try:
        requests = plan(num_requests, load_hf_config(resolve_model_path(folder)).vocab_size,
                        seed)
        with running_server(folder, SERVER_ARGS) as server:
            typer.echo(f"soak: {num_requests} requests, {concurrency} in flight, "
                       f"{'engine dp1 killed at 40%' if kill else 'no fault'} ...")
            with typer.progressbar(length=num_requests, label="soak") as bar:
                result = asyncio.run(run_soak(
                    server.url, server.proc.pid, requests, concurrency,
                    int(num_requests * 0.4) if kill else None, progress=lambda: bar.update(1)))
    except (ValueError, RuntimeError) as e:
        fail(str(e))
    typer.echo(format_report(result))
    if save_json:
        report.save_json(save_json, "soak", {"num_requests": num_requests,
                                             "concurrency": concurrency, "kill": kill,
                                             "seed": seed, "server_args": SERVER_ARGS},
                         {"counts": {k: dict(v) for k, v in result.counts().items()},
                          **{k: v for k, v in dataclasses.asdict(result).items()
                             if k != "outcomes"}})
    problems = result.failures()
    if problems:
        fail("the soak broke its promises:\n  " + "\n  ".join(problems[:20]))


def format_report(r) -> str:
    lines = [f"{len(r.outcomes)} requests in {r.seconds:.1f} s"]
    for kind, counts in sorted(r.counts().items()):
        lines.append(f"  {kind:<11} " + ", ".join(f"{n} {label}" for label, n in
                                                  sorted(counts.items())))
    lines.append("  HTTP answers (server's count): " + ", ".join(
        f"{code}: {n}" for code, n in sorted(r.server_codes.items())))
    lines.append("  failovers: " + (", ".join(f"{k} {v:g}" for k, v in r.failovers.items())
                                    or "none"))
    if r.kill_at is not None:
        settled = "-" if r.settled_after_s is None else f"{r.settled_after_s:.1f} s"
        back = "-" if r.back_after_s is None else f"{r.back_after_s:.1f} s"
        lines.append(f"  dp1 SIGKILLed at {r.kill_at:.1f} s: the requests in flight then all "
                     f"finished within {settled}; dp1 healthy again after {back}")
    if r.rss_mib:
        warm = r.rss_mib[len(r.rss_mib) // 10][1]
        lines.append(f"  server RSS: {warm:.0f} MiB after warm-up, {r.rss_mib[-1][1]:.0f} MiB "
                     f"at the end ({r.rss_growth():+.1%}); peak "
                     f"{max(v for _, v in r.rss_mib):.0f} MiB")
    if len(r.rss_by_process) == 2:
        warm, end = r.rss_by_process
        lines.append("  RSS by process, MiB (warm-up -> end): " + ", ".join(
            f"{name} {warm.get(name, 0):.0f} -> {mib:.0f}" for name, mib in sorted(end.items())))
    lines.append(f"  KV cache usage after the run: {r.kv_usage_after}")
    return "\n".join(lines)


if __name__ == "__main__":
    typer.run(soak)

"""`python scripts/bench_dp_scaling.py`: data-parallel scaling on CPU, interleaved so that a noisy
machine hits every configuration alike. Each round starts a `parashift run` server per
configuration (dp1 on 1 core, dpN on 1 core per rank, dp1 on N cores), sends the same
decode-heavy workload at once over streaming HTTP, and stops it. Then, offline with one
thread, the decode step time at 1, the per-rank and the whole batch, which bounds the scaling,
and the GEMMs' weight-streaming floor, which caps it (step_cost.py)."""

from __future__ import annotations

import statistics
from typing import Annotated, Any

import typer
from study_options import Dtype, InputLenRange, OutputLenRange, Repeat, ServerArgs, served_workload

from parashift.bench.options import NumPrompts, SaveJson, Seed
from parashift.cli_options import ModelArg, fail, setup_logging


def configurations(dp: int) -> dict[str, list[str]]:
    """Name -> the `parashift run` flags of that configuration."""
    return {"dp1, 1 core": ["--threads", "1"],
            f"dp{dp}, 1 core per rank": ["--strategy", f"dp{dp}"],
            f"dp1, {dp} cores": ["--threads", str(dp)]}


def dp_scaling(
    model: ModelArg = None,
    dtype: Dtype = "bfloat16",
    num_prompts: NumPrompts = 32,
    input_len_range: InputLenRange = "16:16",
    output_len_range: OutputLenRange = "256:256",
    dp: Annotated[int, typer.Option("--dp", help="data-parallel ranks (and cores) to compare")
                  ] = 2,
    repeat: Repeat = 3,
    offline_only: Annotated[bool, typer.Option(
        "--offline-only", help="only the offline step costs and the ceiling they give")] = False,
    extra: ServerArgs = "",
    seed: Seed = 0,
    save_json: SaveJson = None,
) -> None:
    """Throughput of dpN (1 core per rank) against dp1 on 1 and on N cores, served, and what
    bounds the scaling, offline."""
    setup_logging()
    from step_cost import TARGET_EFFICIENCY, efficiency_model, step_costs
    from study_server import running_server, send_all, warm_up

    from parashift.bench import report

    if dp < 2:
        fail("--dp must be >= 2")
    if repeat < 1:
        fail("--repeat must be >= 1")
    if num_prompts < dp:
        fail(f"--num-prompts {num_prompts} is below --dp {dp}: every rank needs a request")
    requests, vocab, extra_args = served_workload(model, num_prompts, input_len_range,
                                                  output_len_range, seed, extra)
    total = sum(r.prompt_len + r.output_len for r in requests)
    typer.echo(f"workload: {len(requests)} requests, {total} tokens; dtype {dtype}")
    configs = configurations(dp)
    times: dict[str, list[float]] = {name: [] for name in configs}
    try:
        for round_ in range(0 if offline_only else repeat):
            for name, flags in configs.items():
                with running_server(model, ["--dtype", dtype, *flags, *extra_args]) as server:
                    warm_up(server.url, vocab)
                    times[name].append(send_all(server.url, requests)[0])
                typer.echo(f"round {round_ + 1}: {name}: {times[name][-1]:.2f} s")
    except RuntimeError as e:
        fail(str(e))
    result: dict[str, Any] = {"workload": {"num_requests": len(requests), "total_tokens": total},
                              "configs": {}}
    if not offline_only:
        for name, ts in times.items():
            tput = total / statistics.median(ts)
            result["configs"][name] = {"server_args": " ".join(configs[name]), "elapsed_s": ts,
                                       "total_tokens_per_s": tput}
            typer.echo(f"{name:24s} median {statistics.median(ts):6.2f} s (min {min(ts):6.2f}) "
                       f"{tput:7.1f} tok/s")
        one, ranks = (result["configs"][name]["total_tokens_per_s"] for name in list(configs)[:2])
        result["efficiency"] = ranks / (dp * one)
        typer.echo(f"scaling efficiency dp{dp} / ({dp} x dp1): {result['efficiency']:.2f}")
    # Each rank decodes its share of the batch; a step's weight streaming costs the same at any
    # batch, so step(B) / (dp x step(B/dp)) bounds the efficiency.
    part, whole = len(requests) // dp, len(requests)
    costs = step_costs(model, dtype, (1, part, whole))
    bound = efficiency_model(costs, dp, part, whole)
    result["offline"] = {**costs, **bound}
    step = costs["step_ms"]
    typer.echo(f"offline decode step, 1 thread: {step[1]:.1f} ms at 1 sequence, "
               f"{step[part]:.1f} ms at {part}, {step[whole]:.1f} ms at {whole} -> bound "
               f"{bound['bound']:.2f}")
    typer.echo(f"  = {bound['fixed_ms']:.1f} ms per step + {bound['per_seq_ms']:.2f} ms per "
               f"sequence; the GEMMs alone stream {costs['gemm_weight_bytes'] / 1e6:.0f} MB of "
               f"weights in {costs['gemm_floor_ms']:.1f} ms")
    need = bound[f"per_seq_ms_needed_for_{TARGET_EFFICIENCY}"]
    typer.echo(f"  ceiling with only that floor fixed: {bound['ceiling']:.2f}; "
               f"{TARGET_EFFICIENCY} needs >= {need:.2f} ms per sequence")
    if save_json:
        report.save_json(save_json, "dp-scaling", {
            "model": model, "dtype": dtype, "num_prompts": num_prompts,
            "input_len_range": input_len_range, "output_len_range": output_len_range,
            "dp": dp, "repeat": repeat, "offline_only": offline_only, "server_args": extra,
            "seed": seed}, result)


if __name__ == "__main__":
    typer.run(dp_scaling)

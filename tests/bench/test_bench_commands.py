"""`parashift bench` (throughput, latency, serve, sweep) and the studies in scripts/ (dp-scaling,
tp, pipeline, moe, serving-vs-offline, backends, ...): they parse their flags, refuse bad ones
with an error naming the flag before loading anything; and the arithmetic they print."""

from __future__ import annotations

import re

import pytest
from bench_dp_scaling import configurations
from conftest import STUDIES, study_in_process
from step_cost import efficiency_model
from typer.testing import CliRunner

from parashift.bench.cli import bench_app
from parashift.bench.metrics import prefix_agreement
from parashift.bench.options import sampling_fields


def invoke(*args: str) -> tuple[int, str]:
    """`parashift bench ARGS`, or the study ARGS[0] with the rest (`python scripts/X.py`),
    in this process. Exit code and output (stdout + stderr), with the error box's borders and
    line wraps flattened so that a message reads as one line."""
    env = {"COLUMNS": "200"}
    result = (study_in_process(args[0], *args[1:], env=env) if args and args[0] in STUDIES
              else CliRunner().invoke(bench_app, list(args), env=env))
    text = re.sub(r"[│╭╮╰╯─]+", " ", result.output)
    return result.exit_code, re.sub(r"\s+", " ", text)


def test_bench_lists_what_a_user_runs_and_no_study():
    code, out = invoke("--help")
    assert code == 0
    for name in ("throughput", "latency", "serve", "sweep"):
        assert f" {name} " in out
    for name in STUDIES:
        assert f" {name} " not in out, name


@pytest.mark.parametrize("command, flags", [
    ("dp-scaling", ["--dtype", "--num-prompts", "--input-len-range", "--output-len-range",
                    "--dp", "--repeat", "--offline-only", "--server-args", "--seed",
                    "--save-json"]),
    ("tp", ["--hidden", "--intermediate", "--layers", "--heads", "--kv-heads", "--vocab",
            "--tp", "--dtype", "--batch", "--steps", "--repeat", "--save-json"]),
    ("serving-vs-offline", ["--dtype", "--num-prompts", "--input-len-range",
                            "--output-len-range", "--repeat", "--server-args", "--skip-offline",
                            "--seed", "--save-json"]),
    ("backends", ["--rounds", "--strategy", "--backends", "--num-prompts", "--input-len",
                  "--output-len", "--server-args", "--seed", "--save-json"]),
    ("throughput", ["--baseline", "--hf-batch-size", "--hf-dtype", "--repeat", "--roofline",
                    "--strategy", "--threads", "--sampling"]),
    ("moe", ["--dtype", "--num-prompts", "--concurrency", "--input-len-range",
             "--output-len-range", "--repeat", "--dispatch-tokens", "--save-json"]),
    ("latency", ["--batch-size", "--input-len", "--output-len", "--iters", "--breakdown",
                 "--sampling"]),
    ("serve", ["--base-url", "--request-rate", "--max-concurrency", "--sampling"]),
])
def test_help_shows_every_flag(command, flags):
    code, out = invoke(command, "--help")
    assert code == 0
    for flag in flags:
        assert f" {flag} " in out, flag


@pytest.mark.parametrize("args, message", [
    (["dp-scaling", "--dp", "1"], "--dp must be >= 2"),
    (["dp-scaling", "--repeat", "0"], "--repeat must be >= 1"),
    (["dp-scaling", "--num-prompts", "1"], "--num-prompts 1 is below --dp 2"),
    (["dp-scaling", "--input-len-range", "64:8"], "--input-len-range '64:8': need 1 <= A <= B"),
    (["dp-scaling", "--output-len-range", "x"], "--output-len-range 'x': use N or A:B"),
    (["dp-scaling", "--dtype", "int8"], "Invalid value for '--dtype'"),
    (["tp", "--tp", "1,x"], "Invalid value for --tp: '1,x' is not a list like 1,2,4"),
    (["tp", "--tp", "0"], "Invalid value for --tp: every value must be >= 1"),
    (["tp", "--steps", "1"], "--steps must be >= 2"),
    (["tp", "--kv-heads", "0"], "--kv-heads must be >= 1"),
    (["tp", "--hidden", "100"], "--hidden 100 must split into --heads 16"),
    (["serving-vs-offline", "--repeat", "0"], "--repeat must be >= 1"),
    (["serving-vs-offline", "--server-args", "'--threads 1"], "--server-args \"'--threads 1\""),
    (["serving-vs-offline", "--input-len-range", "0:4"], "--input-len-range '0:4'"),
    (["backends", "--backends", "mp,k8s"], "--backends 'mp,k8s': choose from mp, ray"),
    (["backends", "--rounds", "0"], "--rounds must be >= 1"),
    (["pipeline", "--layouts", "pp9"], "--layouts: unknown ['pp9']"),
    (["pipeline", "--concurrency", "0"], "Invalid value for --concurrency"),
    (["backends", "--bogus"], "No such option: --bogus"),
    (["throughput", "--repeat", "0"], "--repeat must be >= 1"),
    (["throughput", "--hf-dtype", "float32"], "--hf-dtype sets the transformers baseline"),
    (["throughput", "--hf-dtype", "int4"], "Invalid value for '--hf-dtype'"),
    (["throughput", "--sampling", "top_p=2"], "--sampling: top_p must be in (0, 1], got 2.0"),
    (["latency", "--sampling", "temp=1"], "--sampling 'temp=1': expected NAME=VALUE"),
    (["serve", "--base-url", "http://127.0.0.1:9", "--sampling", "top_k=x"],
     "--sampling 'top_k=x': 'x' is not an integer"),
])
def test_bad_flags_fail_naming_the_flag(args, message):
    code, out = invoke(*args)
    assert code == 2 and message in out, out


def test_configurations_compare_ranks_with_one_engine_on_as_many_cores():
    assert configurations(2) == {"dp1, 1 core": ["--threads", "1"],
                                 "dp2, 1 core per rank": ["--strategy", "dp2"],
                                 "dp1, 2 cores": ["--threads", "2"]}
    assert list(configurations(4))[1:] == ["dp4, 1 core per rank", "dp1, 4 cores"]


def test_efficiency_model_reproduces_the_recorded_dp2_figures():
    # docs/BENCHMARKS.md, data-parallel scaling: step(16) 136.7 ms, step(32) 197.4 ms, floor
    # 48.2 ms -> c 3.80 ms, bound 197.4 / (2 x 136.7) = 0.72, ceiling 0.78, 0.85 needs 7.03.
    costs = {"step_ms": {1: 71.6, 16: 136.7, 32: 197.4}, "gemm_floor_ms": 48.2}
    model = efficiency_model(costs, 2, 16, 32)
    assert model["per_seq_ms"] == pytest.approx(3.79, abs=0.01)
    assert model["bound"] == pytest.approx(0.72, abs=0.005)
    assert model["ceiling"] == pytest.approx(0.78, abs=0.005)
    assert model["per_seq_ms_needed_for_0.85"] == pytest.approx(7.03, abs=0.01)


def test_efficiency_model_recovers_a_linear_step_at_any_dp():
    fixed, per_seq, dp, whole = 40.0, 2.0, 4, 32
    part = whole // dp
    costs = {"step_ms": {b: fixed + per_seq * b for b in (1, part, whole)},
             "gemm_floor_ms": fixed}
    model = efficiency_model(costs, dp, part, whole)
    assert model["fixed_ms"] == pytest.approx(fixed)
    assert model["per_seq_ms"] == pytest.approx(per_seq)
    assert model["bound"] == pytest.approx(model["ceiling"])  # nothing fixed beyond the floor
    need = model["per_seq_ms_needed_for_0.85"]
    at_need = (fixed + whole * need) / (dp * fixed + whole * need)
    assert at_need == pytest.approx(0.85)


def test_prefix_agreement_counts_the_common_prefix_of_each_request():
    assert prefix_agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]) == pytest.approx(4 / 5)
    assert prefix_agreement([[1, 2]], [[7, 2]]) == 0.0
    assert prefix_agreement([[]], [[]]) == 0.0


def test_sampling_fields_parse_and_default_to_greedy():
    assert sampling_fields("") == {"temperature": 0.0}
    assert sampling_fields(" temperature = 0.8, top_k=50 ,min_p=0.05") == {
        "temperature": 0.8, "top_k": 50, "min_p": 0.05}
    assert sampling_fields("top_p=0.9") == {"top_p": 0.9}  # temperature stays SamplingParams' 1

"""`parashift bench` end to end: serve against a real `parashift run`, throughput with the
transformers baseline, latency, the tp and serving-vs-offline comparisons on a tiny model, and
bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SCRIPTS, STUDIES, cli_in_process, study_in_process
from PIL import Image
from serve.servers import TINY_ARGS, running_server

pytestmark = pytest.mark.slow

ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB"]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`parashift bench ARGS`, or `python scripts/STUDY.py ARGS[1:]` for a study."""
    if args[0] in STUDIES:
        cmd = [sys.executable, os.path.join(SCRIPTS, STUDIES[args[0]][0] + ".py"), *args[1:]]
    else:
        cmd = [sys.executable, "-m", "parashift.cli", "bench", *args]
    return subprocess.run(cmd,
                          capture_output=True, text=True, timeout=timeout)


def test_serve_writes_a_consistent_json_and_a_png(tiny_llama, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    with running_server(tiny_llama, *TINY_ARGS) as server:
        done = bench("serve", "--base-url", server.url, "--num-prompts", "12",
                     "--request-rate", "50", "--input-len-range", "4:12", "--output-len", "8",
                     "--vocab-size", "300", "--goodput", "ttft:60000", "--seed", "3",
                     "--sampling", "temperature=0.9,top_p=0.8,seed=5",
                     "--save-json", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Successful requests:              12" in done.stdout
    doc = json.loads(out.read_text())
    results, requests = doc["results"], doc["requests"]
    assert doc["command"] == "serve" and doc["settings"]["seed"] == 3
    assert doc["settings"]["sampling"] == {"temperature": 0.9, "top_p": 0.8, "seed": 5}
    assert {"torch", "cpu", "cores", "parashift"} <= set(doc["environment"])
    assert (results["completed"], results["failed"], len(requests)) == (12, 0, 12)
    assert results["output_tokens"] == 12 * 8 == sum(r["generated"] for r in requests)
    assert results["input_tokens"] == sum(r["prompt_len"] for r in requests)
    assert all(4 <= r["prompt_len"] <= 12 for r in requests)
    for r in requests:
        assert 0 < r["ttft"] <= r["e2e"]
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / 7)
    assert results["goodput"]["requests"] == 12
    assert results["e2e_ms"]["max"] >= results["e2e_ms"]["p99"] >= results["e2e_ms"]["median"]
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_throughput_against_transformers_prints_both(tiny_llama, tmp_path):
    png, out = tmp_path / "throughput.png", tmp_path / "throughput.json"
    done = bench("throughput", tiny_llama, *ENGINE, "--num-prompts", "8", "--input-len", "16",
                 "--output-len", "8", "--baseline", "hf", "--repeat", "2", "--roofline",
                 "--plot", str(png), "--save-json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("parashift ") for line in lines)
    assert any(line.startswith("hf float32 bs32 ") for line in lines)
    assert "parashift / hf:" in done.stdout and "greedy outputs agree on" in done.stdout
    assert "roofline: " in done.stdout and "GFLOP/s" in done.stdout
    results = json.loads(out.read_text())["results"]
    for system in ("parashift", "hf"):
        r = results[system]
        assert len(r["elapsed_s"]) == 2 and 0 < r["fraction_of_roofline"] < 1
        assert r["total_tokens_per_s"] == pytest.approx(8 * 24 / r["elapsed_median_s"])
    assert 0 <= results["greedy_prefix_agreement"] <= 1
    with Image.open(png) as image:
        assert image.format == "PNG"


def test_tp_compares_tp1_with_both_all_reduce_paths(tiny_llama, tmp_path):
    out = tmp_path / "tp.json"
    done = bench("tp", tiny_llama, "--tp", "1,2", "--batch", "2", "--steps", "4", "--repeat",
                 "1", "--save-json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    for label in ("tp1:", "tp2 shm:", "tp2 gloo:", "speed-up tp2 (shm) over tp1",
                  "speed-up tp2 (gloo) over tp1"):
        assert label in done.stdout, done.stdout
    results = json.loads(out.read_text())["results"]["results"]
    assert [(r["tp"], r["all_reduce"]) for r in results] == [(1, "none"), (2, "shm"),
                                                              (2, "gloo")]
    assert all(0 < r["allreduce_fraction"] < 1 and r["allreduces_per_step"] > 0
               for r in results[1:])
    assert [len(r["load_peak_rss_mib"]) for r in results] == [1, 2, 2]
    assert "model load peak RSS" in done.stdout


def test_pipeline_compares_pp2_with_pp1_and_asks_plan_for_the_bubble(tiny_llama, tmp_path):
    out = tmp_path / "pipeline.json"
    done = bench("pipeline", tiny_llama, "--concurrency", "1,2", "--num-requests", "2",
                 "--repeat", "1", "--dtype", "float32", "--layouts",
                 "pp1 1 core,pp2 1 core/stage", "--save-json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pp2 1 core/stage over pp1 1 core, prefill-heavy c=2" in done.stdout
    rows = json.loads(out.read_text())["results"]["results"]
    assert len(rows) == 2 * 2 * 2  # layouts x workloads x concurrencies
    for row in rows:
        assert row["median_tokens_per_s"] > 0 and row["median_ttft_ms"] > 0
        if row["layout"].startswith("pp2"):
            assert 0 <= row["measured_bubble"] < 1 and row["transfer_ms"] > 0
            # plan's answer: one request leaves one of two balanced stages idle
            if row["concurrency"] == 1:
                assert row["plan_bubble"] == pytest.approx(0.5, abs=0.05)


def test_serving_vs_offline_starts_its_server_and_stops_it(tiny_llama, tmp_path):
    out = tmp_path / "serving.json"
    done = bench("serving-vs-offline", tiny_llama, "--dtype", "float32", "--num-prompts", "4",
                 "--input-len-range", "8:16", "--output-len-range", "4:8", "--repeat", "2",
                 "--server-args", " ".join(ENGINE[2:]), "--save-json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "serving / offline throughput:" in done.stdout and "ttft  mean" in done.stdout
    doc = json.loads(out.read_text())
    results = doc["results"]
    assert len(results["offline"]["elapsed_s"]) == len(results["serve"]["elapsed_s"]) == 2
    assert results["ratio_serve_over_offline"] > 0
    assert len(doc["requests"]) == 2 * 4 and all(r["error"] is None for r in doc["requests"])
    assert all(4 <= r["generated"] <= 8 for r in doc["requests"])


def test_a_server_that_cannot_start_is_an_error_with_its_output():
    from study_server import start_server

    with pytest.raises(RuntimeError, match="exited with code") as e:
        start_server("/nonexistent-model", [], timeout=120)
    assert "/nonexistent-model" in str(e.value)


def test_latency_reports_percentiles(tiny_llama):
    done = bench("latency", tiny_llama, *ENGINE, "--batch-size", "2", "--input-len", "8",
                 "--output-len", "4", "--iters", "3", "--warmup", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 iterations: mean" in done.stdout and "p99" in done.stdout


def test_latency_breakdown_splits_a_decode_step(tiny_llama, tmp_path):
    """With a sampling mode and a constraint: the sampler's and the grammar mask's shares of
    the step are buckets of their own."""
    out = tmp_path / "latency.json"
    done = bench("latency", tiny_llama, *ENGINE, "--batch-size", "4", "--input-len", "8",
                 "--output-len", "6", "--iters", "1", "--breakdown", "--save-json", str(out),
                 "--sampling", "temperature=0.8,top_k=20,repetition_penalty=1.1",
                 "--structured-regex", "[a-z]{64}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "decode step at batch 4" in done.stdout and "GEMM floor" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["settings"]["sampling"] == {"temperature": 0.8, "top_k": 20,
                                           "repetition_penalty": 1.1}
    result = doc["results"]["breakdown"]
    buckets = result["buckets_ms"]
    assert set(buckets) == {"gemm", "attention", "sampling", "grammar", "other_ops", "python"}
    assert buckets["gemm"] > 0 and buckets["attention"] > 0 and buckets["sampling"] > 0
    assert buckets["grammar"] > 0 and doc["settings"]["structured_regex"] == "[a-z]{64}"
    assert result["decode_steps"] == 5 and result["gemm_floor_ms"] > 0
    # The buckets are the profiled step's ops and the rest of its wall time.
    assert sum(buckets.values()) == pytest.approx(result["profiled_step_ms"], rel=0.5)


@pytest.mark.parametrize("kind,hit_rate", [("one-schema", 7 / 8), ("distinct-schemas", 1 / 2)])
def test_structured_study_against_unconstrained(tiny_llama, tmp_path, kind, hit_rate):
    """`python scripts/bench_structured.py`, in this process."""
    out = tmp_path / "structured.json"
    done = study_in_process("structured", tiny_llama, "--dtype", "float32", "--max-model-len",
                            "1024", "--kv-cache-memory", "32MiB", "--schemas", kind,
                            "--num-prompts", "4", "--save-json", str(out))
    assert done.exit_code == 0, done.output[-3000:]
    assert f"4 requests under {kind}" in done.stdout and "compile cache hit rate" in done.stdout
    result = json.loads(out.read_text())["results"]
    assert result["output_tokens"] > 0 and result["ratio"] > 0
    # each request's constraint is compiled once (distinct) or once for all (one schema); the
    # engine and the offline check both ask the cache
    assert result["compile_cache_hit_rate"][0] == pytest.approx(hit_rate)


def test_bench_moe_compares_ep_with_replicated_experts(tiny_model_factory, tmp_path):
    out = tmp_path / "moe.json"
    done = bench("moe", tiny_model_factory("mixtral"), "--dtype", "float32", "--num-prompts",
                 "8", "--concurrency", "4", "--input-len-range", "8:16", "--output-len-range",
                 "4:4", "--repeat", "1", "--dispatch-tokens", "16", "--save-json", str(out),
                 timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dp2xep over dp2: throughput" in done.stdout
    results = json.loads(out.read_text())["results"]
    sharded = results["layouts"]["dp2xep"]
    replicated = results["layouts"]["dp2 (experts replicated)"]
    # 5 experts: dp0 holds 3, dp1 2; replicated, each holds all 5.
    assert sharded["weight_bytes_per_rank"]["0"] > sharded["weight_bytes_per_rank"]["1"]
    assert replicated["weight_bytes_per_rank"]["0"] > sharded["weight_bytes_per_rank"]["0"]
    assert results["expert_memory_ratio"] == pytest.approx(3 / 5)
    assert 0 < sharded["dispatch_share"]["0"] < 1 and "dispatch_share" not in replicated
    assert set(results["dispatch_methods"]["16"]) == {
        "all-gather+reduce-scatter", "gather/scatter over all-to-all", "routed all-to-all"}


@pytest.mark.parametrize("args, message", [
    (["--dataset", "/nonexistent.jsonl"], "--dataset /nonexistent.jsonl: no such file"),
    (["--input-len-range", "64:8"], "--input-len-range '64:8': need 1 <= A <= B"),
    (["--baseline", "vllm"], "--baseline 'vllm'"),
])
def test_bad_throughput_input_names_the_flag(tiny_llama, args, message):
    done = cli_in_process("bench", "throughput", tiny_llama, *ENGINE, *args)
    assert done.exit_code == 2 and message in done.stderr, done.output[-2000:]


def test_latency_batch_above_max_num_seqs_names_both_flags(tiny_llama):
    done = cli_in_process("bench", "latency", tiny_llama, *ENGINE, "--batch-size", "9",
                            "--max-num-seqs", "8")
    assert done.exit_code == 2
    assert "--batch-size 9 is above --max-num-seqs 8" in done.stderr, done.output[-2000:]


def test_serve_with_nothing_listening_fails_clearly():
    done = bench("serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2",
                 timeout=120)
    assert done.returncode == 2 and "--base-url http://127.0.0.1:9" in done.stderr

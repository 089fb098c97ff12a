"""`parashift bench` end to end: serve against a real `parashift run`, throughput with the
transformers baseline, latency, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from PIL import Image

from tests.serve.conftest import TINY_ARGS, running_server

pytestmark = pytest.mark.slow

ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB"]


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parashift.cli", "bench", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_serve_writes_a_consistent_json_and_a_png(tiny_llama, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    with running_server(tiny_llama, *TINY_ARGS) as server:
        done = bench("serve", "--base-url", server.url, "--num-prompts", "12",
                     "--request-rate", "50", "--input-len-range", "4:12", "--output-len", "8",
                     "--vocab-size", "300", "--goodput", "ttft:60000", "--seed", "3",
                     "--save-json", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Successful requests:              12" in done.stdout
    doc = json.loads(out.read_text())
    results, requests = doc["results"], doc["requests"]
    assert doc["command"] == "serve" and doc["settings"]["seed"] == 3
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
    png = tmp_path / "throughput.png"
    done = bench("throughput", tiny_llama, *ENGINE, "--num-prompts", "8", "--input-len", "16",
                 "--output-len", "8", "--baseline", "hf", "--plot", str(png))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("parashift ") for line in lines)
    assert any(line.startswith("hf ") for line in lines)
    assert "parashift / hf:" in done.stdout
    with Image.open(png) as image:
        assert image.format == "PNG"


def test_latency_reports_percentiles(tiny_llama):
    done = bench("latency", tiny_llama, *ENGINE, "--batch-size", "2", "--input-len", "8",
                 "--output-len", "4", "--iters", "3", "--warmup", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 iterations: mean" in done.stdout and "p99" in done.stdout


@pytest.mark.parametrize("args, message", [
    (["--dataset", "/nonexistent.jsonl"], "--dataset /nonexistent.jsonl: no such file"),
    (["--input-len-range", "64:8"], "--input-len-range '64:8': need 1 <= A <= B"),
    (["--baseline", "vllm"], "--baseline 'vllm'"),
])
def test_bad_throughput_input_names_the_flag(tiny_llama, args, message):
    done = bench("throughput", tiny_llama, *ENGINE, *args, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_latency_batch_above_max_num_seqs_names_both_flags(tiny_llama):
    done = bench("latency", tiny_llama, *ENGINE, "--batch-size", "9", "--max-num-seqs", "8",
                 timeout=120)
    assert done.returncode == 2
    assert "--batch-size 9 is above --max-num-seqs 8" in done.stderr, done.stderr[-2000:]


def test_serve_with_nothing_listening_fails_clearly():
    done = bench("serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2",
                 timeout=120)
    assert done.returncode == 2 and "--base-url http://127.0.0.1:9" in done.stderr

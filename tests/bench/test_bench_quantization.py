"""`python scripts/bench_quantization.py`: the study on a tiny model (in process), its bad
flags, and the accuracy of weight-only int8 / int4 against float32 on the real SmolLM2."""

from __future__ import annotations

import json

import pytest
from bench_quantization import PROMPTS, compare
from conftest import study_in_process

from parashift.engine.args import EngineArgs

ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB"]


def bench(*args: str):
    return study_in_process("quantization", *args)


def test_the_command_prints_and_saves_accuracy_memory_and_speed(tiny_llama, tmp_path):
    out = tmp_path / "q.json"
    done = bench(tiny_llama, *ENGINE, "--num-prompts", "3", "--output-len", "4",
                 "--batch-sizes", "1,2", "--save-json", str(out))
    assert done.exit_code == 0, done.output
    lines = done.stdout.splitlines()
    assert lines[-4].split()[:3] == ["weights", "MiB", "top-1"]
    assert [line.split()[0] for line in lines[-3:]] == ["none", "int8", "int4"]
    results = json.loads(out.read_text())["results"]
    for method in ("int8", "int4"):
        row = results[method]
        assert row["positions"] == 3 * 4 and row["prompts"] == 3
        assert 0 <= row["top1_agreement"] <= 1 and 0 <= row["identical_continuations"] <= 3
        assert row["weight_bytes"] < results["none"]["weight_bytes"]
        assert set(row["decode_tok_s"]) == {"1", "2"} and min(row["decode_tok_s"].values()) > 0


@pytest.mark.parametrize("args,message", [
    (["--methods", "int3"], "--methods 'int3': choose from int8, int4"),
    (["--num-prompts", "99"], f"--num-prompts must be in 1..{len(PROMPTS)}"),
    (["--quantization", "int8"], "--quantization: this command runs the methods of --methods"),
    (["--batch-sizes", "1,9", "--max-num-seqs", "8"], "--batch-sizes 9 is above --max-num-seqs 8"),
    (["--quantization", "int3"], "'int3' is not one of"),
])
def test_bad_flags_are_named(tiny_llama, args, message):
    done = bench(tiny_llama, *ENGINE, *args)
    assert done.exit_code == 2 and message in done.stderr, done.output


@pytest.mark.slow
def test_int8_and_int4_stay_close_to_float32_on_smollm2():
    """Teacher-forced on float32's greedy continuations of 8 prompts (16 tokens each). Measured
    here: 97-98% top-1 agreement, mean |delta log-probability| 0.02-0.05
    (docs/benchmarks/sittings-from-2026-12-05.md)."""
    results = compare(EngineArgs(dtype="float32"), ["int8", "int4"], PROMPTS[:8], 16, [])
    full = results["none"]["weight_bytes"]
    for method, most_bytes in (("int8", 0.55), ("int4", 0.47)):
        row = results[method]
        assert row["top1_agreement"] >= 0.9, row
        assert row["mean_abs_logprob_delta"] < 0.1 and row["not_in_top"] == 0, row
        # the embedding stays float32, and the LM head tied to it keeps its own prepared copy
        # (layers/gemm_paths.py): twice 28 M of the 134.5 M parameters
        assert row["weight_bytes"] < most_bytes * full

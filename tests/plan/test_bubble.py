"""The pipeline bubble `plan` predicts (plan/bubble.py) and where `plan` shows it."""

from __future__ import annotations

import pytest
from conftest import plan_json

from parashift.plan.bubble import bubble

EVEN = (1.0, 0.0)  # a stage's cost per token, and per sampled row


def test_balanced_stages_idle_only_without_a_batch_each():
    assert bubble([EVEN], 1) == 0.0
    assert bubble([EVEN] * 2, 1) == pytest.approx(0.5)
    assert bubble([EVEN] * 4, 2) == pytest.approx(0.5)
    assert bubble([EVEN] * 2, 4) == pytest.approx(0.0)
    assert bubble([EVEN] * 2, 4, prompt_tokens=256) == pytest.approx(0.0)  # prefill only


def test_the_slowest_stage_sets_the_pace():
    # 2 batches in flight, stage 1 twice as slow: stage 0 idles half the round
    assert bubble([(1.0, 0.0), (2.0, 0.0)], 32) == pytest.approx(0.25)
    # the LM head costs the last stage per sampled row, whatever the prompt
    assert bubble([(1.0, 0.0), (1.0, 1.0)], 32) == pytest.approx(0.25)


def test_prefill_heavy_batches_are_uneven_with_few_requests():
    """256 in, 4 out, two stages. With 4 requests a round holds one prompt or two, and whole
    prompts cannot be shared evenly between two batches: about a third idle (the benchmark
    measured 29-31% on SmolLM2). With 32 the scheduler's even token share spreads the prompts
    that arrive together over the batches, and the steady state idles only a few percent."""
    works = [EVEN, EVEN]
    assert 0.25 < bubble(works, 4, 256, 4) < 0.4
    assert bubble(works, 32, 256, 4) < 0.08
    assert bubble(works, 4, 256, 4) > bubble(works, 32, 256, 4) >= bubble(works, 128, 256, 4)


def test_a_smaller_token_budget_changes_the_batches_plan_replays():
    # 64 prompts of 256 at a budget of 256 tokens: every batch is one whole prompt, even
    works = [EVEN, EVEN]
    assert bubble(works, 64, 256, 1, max_num_batched_tokens=256) == pytest.approx(0.0)
    assert bubble(works, 3, 256, 1) > bubble(works, 3, 256, 1, max_num_batched_tokens=256)


def test_plan_reports_stage_ranges_and_bubbles(tiny_model_factory):
    folder = tiny_model_factory("llama", num_hidden_layers=5)
    doc = plan_json(folder, "pp2")
    assert [(s["first_layer"], s["layers"]) for s in doc["memory_per_device"]] == [(0, 3), (3, 2)]
    assert set(doc["pipeline_bubble"]) == {"decode", "prefill"}
    decode = doc["pipeline_bubble"]["decode"]
    assert decode["1"] > decode["4"] == decode["32"]
    assert plan_json(folder, "pp1")["pipeline_bubble"] == {}
    partitioned = plan_json(folder, "pp2", "--pp-layer-partition", "1,4")
    assert [s["layers"] for s in partitioned["memory_per_device"]] == [1, 4]


def test_a_partition_of_the_wrong_length_is_a_plan_error_not_a_crash(tiny_model_factory):
    import json
    import subprocess
    import sys

    folder = tiny_model_factory("llama", num_hidden_layers=5)
    done = subprocess.run([sys.executable, "-m", "parashift.cli", "plan", folder, "--strategy",
                           "pp3", "--pp-layer-partition", "4,1", "--device", "cpu", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["errors"] == [
        "strategy pp3: --pp-layer-partition 4,1 has 2 stage(s), the strategy has pp3"]


def test_plan_replays_the_scheduler_without_importing_torch():
    """`plan` answers in about a second because it never loads torch; its bubble drives the
    engine's own Scheduler, which must stay torch-free too."""
    import subprocess
    import sys

    code = ("import sys; from parashift.cli import app; sys.argv = ['parashift', 'plan', "
            "'Llama-3.1-8B', '--strategy', 'pp2', '--device', 'h100-80g', '--devices', '2', "
            "'--json']\ntry:\n    app()\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'plan imported torch'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"pipeline_bubble"' in done.stdout

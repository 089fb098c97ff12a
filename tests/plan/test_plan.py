"""`parashift plan`: hand-checked memory and mesh numbers, KV capacity equal to what the
engine allocates, --auto rankings that follow the model, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import cli_in_process

from parashift.plan.auto import rank_plans
from parashift.plan.estimate import PlanSettings, make_plan
from parashift.plan.hardware import DEVICES, INTER_NODE, GiB
from parashift.plan.presets import PRESETS
from parashift.strategies.spec import StrategySpec

H100 = DEVICES["h100-80g"]


def plan(model: str, strategy: str, devices: int = 8, **kwargs):
    return make_plan(PRESETS[model], StrategySpec.parse(strategy),
                     PlanSettings(H100, devices, **kwargs))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parashift.cli", "plan", *args],
                          capture_output=True, text=True, timeout=120)


def test_llama_70b_dp4xtp2_does_not_fit_in_bf16_and_says_why():
    p = plan("Llama-3.1-70B", "dp4xtp2")
    # 70.6 B parameters x 2 bytes over 2 ranks: ~65.7 GiB of weights per GPU of 72 GiB usable.
    assert p.stages[0].weights / GiB == pytest.approx(70.6e9 * 2 / 2 / GiB, rel=0.01)
    assert not p.fits
    assert "KV cache below one max-length sequence" in p.errors[0]
    assert "max_model_len 131072" in p.errors[0]
    done = run_cli("Llama-3.1-70B", "--strategy", "dp4xtp2", "--devices", "8", "--device",
                   "h100-80g", "--json")
    doc = json.loads(done.stdout)
    assert done.returncode == 1 and doc["fits"] is False and doc["errors"] == p.errors


def test_llama_70b_tp8_fits_with_its_kv_capacity():
    p = plan("Llama-3.1-70B", "tp8")
    assert p.fits and p.runnable
    st = p.stages[0]
    # Per GPU: 8 kv heads / 8 ranks = 1 head x 128 dims x K and V x 80 layers x 2 bytes.
    block_bytes = 16 * 1 * 128 * 2 * 80 * 2
    budget = int(0.9 * 80 * GiB)
    assert st.kv_blocks == (budget - st.weights - st.reserve) // block_bytes
    assert p.kv_tokens == st.kv_blocks * 16 > 131072
    assert p.concurrent_max_len_seqs == pytest.approx(p.kv_tokens / 131072)
    assert p.comm["tp all-reduce"]["count_per_step"] == 2 * 80 + 1


def test_qwen3_moe_dp8xep_puts_e_over_8_experts_per_rank():
    with_ep, without = plan("Qwen3-30B-A3B", "dp8xep"), plan("Qwen3-30B-A3B", "dp8")
    assert with_ep.experts_per_rank == 128 // 8
    assert without.experts_per_rank == 128
    shape = PRESETS["Qwen3-30B-A3B"]
    saved = shape.moe_layers * (128 - 16) * shape.expert_params() * 2
    assert without.stages[0].weights - with_ep.stages[0].weights == saved
    assert with_ep.comm["ep all-gather+reduce-scatter"]["group_size"] == 8
    assert with_ep.fits and with_ep.runnable


def test_qwen3_moe_dp4xep_over_2_nodes_places_experts_per_node_in_json():
    """Each node holds the union of its ranks' expert ranges (the mesh rows' [first, end)),
    and the nodes partition the 128 experts."""
    done = run_cli("Qwen3-30B-A3B", "--strategy", "dp4xep", "--nodes", "2", "--device",
                   "h100-80g", "--json")
    doc = json.loads(done.stdout)
    assert done.returncode == 0, done.stderr
    held: dict[int, tuple[list[int], set[int]]] = {}
    for row in doc["mesh"]:
        ranks, experts = held.setdefault(row["node"], ([], set()))
        ranks.append(row["rank"])
        experts.update(range(*row["experts"]))
    assert doc["expert_placement"] == [
        {"node": node, "ranks": ranks, "experts": sorted(experts)}
        for node, (ranks, experts) in sorted(held.items())]
    assert [(n["ranks"], n["experts"][0], n["experts"][-1]) for n in doc["expert_placement"]
            ] == [([0, 1], 0, 63), ([2, 3], 64, 127)]
    every = [e for n in doc["expert_placement"] for e in n["experts"]]
    assert sorted(every) == list(range(128))  # each expert on exactly one node
    without_ep = run_cli("Qwen3-30B-A3B", "--strategy", "dp4", "--nodes", "2", "--device",
                         "h100-80g", "--json")
    assert "expert_placement" not in json.loads(without_ep.stdout)
    assert "dispatch" not in json.loads(without_ep.stdout)


def test_qwen3_moe_dp4xep_dispatch_bytes_across_nodes_by_hand():
    """Per token and MoE layer a rank sends its hidden state (2048 x 2 bytes, bf16) to each
    peer and each peer's partial back; rank 0 of 2 nodes x 2 ranks has 2 peers off its node;
    48 MoE layers. One node: nothing crosses."""
    two = plan("Qwen3-30B-A3B", "dp4xep", devices=4, nodes=2).dispatch
    vector = 2048 * 2
    assert two["bytes_per_token_per_layer"] == vector
    assert two["cross_node_bytes_per_token"] == 2 * 2 * vector * 48 == 786_432
    assert two["total_cross_node_bytes_per_token"] == 4 * 786_432  # every rank, each byte once
    # All peers, on or off the node: the communication table's ep row.
    with_ep = plan("Qwen3-30B-A3B", "dp4xep", devices=4, nodes=2)
    assert two["bytes_per_token"] == 2 * 3 * vector * 48 == (
        with_ep.comm["ep all-gather+reduce-scatter"]["bytes_per_token"])
    one = plan("Qwen3-30B-A3B", "dp4xep", devices=4).dispatch
    assert one["cross_node_bytes_per_token"] == one["total_cross_node_bytes_per_token"] == 0
    assert one["bytes_per_token"] == two["bytes_per_token"]
    # tp: every tp worker exchanges the whole hidden state in its own ep group.
    tp2 = plan("Qwen3-30B-A3B", "dp4xtp2xep", devices=8, nodes=2).dispatch
    assert tp2["num_groups"] == 2 and tp2["cross_node_bytes_per_token"] == 786_432
    assert tp2["total_cross_node_bytes_per_token"] == 2 * 4 * 786_432
    assert plan("Qwen3-30B-A3B", "tp2xep", devices=2).dispatch is None  # one engine


def test_dispatch_bytes_count_each_ranks_off_node_peers():
    from parashift.plan.experts import dispatch_bytes

    # 3 ranks on node 0, 1 on node 1: that one has 3 peers off its node, the others 1 each.
    d = dispatch_bytes(hidden_size=8, moe_layers=2, dtype_bytes=4, group_nodes=[[0, 0, 0, 1]])
    per_peer = 2 * 8 * 4 * 2
    assert d["bytes_per_token"] == 3 * per_peer
    assert d["cross_node_bytes_per_token"] == 3 * per_peer
    assert d["total_cross_node_bytes_per_token"] == (1 + 1 + 1 + 3) * per_peer


def test_text_names_each_nodes_experts():
    done = cli_in_process("plan", "Qwen3-30B-A3B", "--strategy", "dp4xep", "--nodes", "2",
                          "--device", "h100-80g")
    assert done.exit_code == 0, done.stdout
    text = " ".join(done.stdout.split())
    assert "experts per node" in text
    assert "│ 0 │ 0, 1 │ 0-63 │" in text and "│ 1 │ 2, 3 │ 64-127 │" in text
    assert "a rank sends 1,179,648 bytes, 786,432 of them to other nodes" in text


def test_mesh_rows_and_process_names_in_json():
    done = run_cli("Qwen3-8B", "--strategy", "dp2xtp2", "--device", "h100-80g", "--json")
    doc = json.loads(done.stdout)
    assert done.returncode == 0
    assert [(r["dp"], r["tp"], r["device"]) for r in doc["mesh"]] == [
        (0, 0, "cuda:0"), (0, 1, "cuda:1"), (1, 0, "cuda:2"), (1, 1, "cuda:3")]
    assert doc["mesh"][3]["process_name"] == "parashift-worker-dp1-tp1"


def _engine_blocks(model: str, dtype: str, budget: int, tp: int = 1) -> int:
    from parashift import LLM

    llm = LLM(model, dtype=dtype, max_model_len=256, kv_cache_memory=budget,
              tensor_parallel_size=tp)
    try:
        return llm.engine.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("budget_mib, tp", [(8, 1), (33, 1), (8, 2)])
def test_kv_capacity_equals_the_engines_tiny(tiny_llama, budget_mib, tp):
    done = run_cli(tiny_llama, "--strategy", f"tp{tp}", "--device", "cpu", "--dtype", "fp32",
                   "--kv-cache-memory", f"{budget_mib}MiB", "--max-model-len", "256", "--json")
    doc = json.loads(done.stdout)
    assert doc["kv_capacity"]["blocks"] == _engine_blocks(tiny_llama, "float32",
                                                          budget_mib << 20, tp)


@pytest.mark.slow
@pytest.mark.parametrize("budget_mib", [64, 300])
def test_kv_capacity_equals_the_engines_smollm2(smollm2_path, budget_mib):
    done = run_cli(smollm2_path, "--device", "cpu", "--dtype", "bf16", "--kv-cache-memory",
                   f"{budget_mib}MiB", "--max-model-len", "256", "--json")
    doc = json.loads(done.stdout)
    blocks = _engine_blocks(smollm2_path, "bfloat16", budget_mib << 20)
    assert doc["kv_capacity"]["blocks"] == blocks
    assert doc["kv_capacity"]["tokens"] == blocks * 16


def test_auto_prefers_dp_for_throughput_when_the_model_fits_one_device():
    plans, why = rank_plans(PRESETS["Llama-3.1-8B"], PlanSettings(H100, 8))
    assert str(plans[0].spec) == "dp8" and why.startswith("dp8: the highest decode throughput")
    # For one sequence's latency, splitting the weights over tp ranks wins instead.
    latency, why = rank_plans(PRESETS["Llama-3.1-8B"], PlanSettings(H100, 8), "latency")
    assert latency[0].spec.size("tp") >= 4 and "lowest time per output token" in why
    tpot = {str(p.spec): p.estimate["tpot_single_ms"] for p in latency}
    assert tpot["tp8"] < tpot["dp4xtp2"] < tpot["dp8"]


def test_auto_keeps_tp_within_a_node():
    settings = PlanSettings(H100, 16, nodes=2, inter=INTER_NODE["ethernet"])
    plans, _ = rank_plans(PRESETS["Llama-3.1-70B"], settings)
    order = [str(p.spec) for p in plans]
    assert order.index("dp2xtp8") < order.index("tp16")
    assert any("crosses nodes" in w for p in plans if str(p.spec) == "tp16" for w in p.warnings)


def test_auto_skips_what_does_not_fit():
    plans, _ = rank_plans(PRESETS["Llama-3.1-70B"], PlanSettings(H100, 8))
    assert plans and all(p.fits for p in plans)
    assert "dp8" not in {str(p.spec) for p in plans}  # 141 GB on one 80 GB device


@pytest.mark.parametrize("args, message", [
    (["Llama-9000"], "presets: Llama-3.1-8B, Llama-3.1-70B"),
    (["Llama-3.1-8B", "--devices", "0"], "--devices 0: need at least one device"),
    (["Llama-3.1-8B", "--strategy", "dp4xtp2", "--devices", "4"],
     "strategy dp4xtp2 needs 8 devices; --devices is 4"),
    (["Llama-3.1-8B", "--device", "tpu-v9"], "--device 'tpu-v9': known devices are"),
    (["Llama-3.1-8B", "--strategy", "tp3"], "tp3 needs num_attention_heads (32) divisible"),
    (["Llama-3.1-8B", "-q", "int8", "--device", "h100-80g"],
     "--quantization int8 runs on --device cpu, not on h100-80g"),
])
def test_bad_input_is_a_clear_error(args, message):
    done = run_cli(*args)
    assert done.returncode != 0
    assert message in done.stderr + done.stdout, done.stderr + done.stdout


@pytest.mark.parametrize("args, message", [
    (["--block-size", "24"], "--block-size must be a power of two, got 24"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--gemm-paths", "onednn"], "--gemm-paths onednn: choose among"),
    (["--strategy", "tp4", "-tp", "2"], "--strategy tp4 sets tp=4 but --tensor-parallel-size is 2"),
])
def test_engine_flags_are_checked_as_the_engines_config_checks_them(args, message):
    result = cli_in_process("plan", "Llama-3.1-8B", "--device", "h100-80g", *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr


def test_plan_takes_runs_engine_flags():
    """Same options, aliases, help and defaults as `run`; --dtype adds plan's what-if fp8."""
    from typing import get_args

    from typer.main import get_command

    from parashift.cli import app
    from parashift.plan.cli import ENGINE_FLAGS

    def described(param) -> dict:
        return {"opts": param.opts, "secondary_opts": param.secondary_opts, "help": param.help,
                "default": param.default, "type": param.type_descriptor.annotation}

    root = get_command(app)
    run, plan = ({p.name: described(p) for p in root.commands[name].params
                  if p.name in ENGINE_FLAGS} for name in ("run", "plan"))
    assert set(plan) == set(ENGINE_FLAGS)
    for name in ENGINE_FLAGS:
        assert plan[name]["opts"] == run[name]["opts"], name
        if name != "dtype":
            assert plan[name] == run[name], name
    assert get_args(plan["dtype"]["type"]) == (*get_args(run["dtype"]["type"]), "fp8")
    done = cli_in_process("plan", "Llama-3.1-8B", "-tp", "2", "-pp", "2", "--device",
                          "h100-80g", "--json")
    assert json.loads(done.stdout)["strategy"] == "pp2xtp2", done.stderr


def test_cpu_placement_is_this_machines_and_says_when_oversubscribed(tiny_split_by_3):
    import os

    cores = sorted(os.sched_getaffinity(0))
    done = run_cli(tiny_split_by_3, "--strategy", "tp3", "--device", "cpu", "--json")
    doc = json.loads(done.stdout)
    assert done.returncode == 0, done.stderr
    placed = [c for r in doc["mesh"] for c in r["cpu_ids"]]
    assert set(placed) <= set(cores)  # never a core this machine does not have
    oversubscribed = any("oversubscribed" in w for w in doc["warnings"])
    assert oversubscribed == (len(cores) < 3)


def test_the_ranks_that_fit_the_machine():
    """Elastic dp's ceiling: on GPUs the devices an engine's workers seat; on a CPU the
    memory every rank shares, each rank holding each worker's weights, reserve and KV."""
    assert plan("Llama-3.1-8B", "dp2xtp2").ranks_that_fit == 4  # 8 devices / 2 per rank
    cpu = DEVICES["cpu"]
    one = make_plan(PRESETS["Llama-3.1-8B"], StrategySpec.parse("dp1"),
                    PlanSettings(cpu, 1, device_memory=64 * GiB, kv_cache_memory=4 * GiB))
    per_rank = sum(st.budget for st in one.stages)
    assert one.ranks_that_fit == (64 * GiB) // per_rank >= 1
    tp2 = make_plan(PRESETS["Llama-3.1-8B"], StrategySpec.parse("tp2"),
                    PlanSettings(cpu, 2, device_memory=64 * GiB, kv_cache_memory=4 * GiB))
    assert tp2.ranks_that_fit == (64 * GiB) // (2 * tp2.stages[0].budget)


def test_prefill_decode_pools_in_json_and_text():
    """`plan` names each pool's engines and the KV a handed-off prompt moves, through the host
    tier the pools turn on (512 MiB by default; Qwen3-8B bf16: 36 layers x K/V x 8 kv heads x
    128 x 2 bytes = 147,456 bytes a token)."""
    code, out, _ = (lambda r: (r.exit_code, r.stdout, r.stderr))(cli_in_process(
        "plan", "Qwen3-8B", "--strategy", "p1xd2xtp2", "--device", "h100-80g", "--json"))
    assert code == 0, out
    doc = json.loads(out)
    assert doc["strategy"] == "p1xd2xtp2" and len(doc["mesh"]) == 6
    assert doc["pools"] == {"prefill": [0], "decode": [1, 2],
                            "kv_link": "the node's host KV tier (shared memory)",
                            "kv_bytes_per_prompt_token": 147456}
    assert doc["kv_tiers"]["host"]["size_bytes"] == 512 << 20
    text = cli_in_process("plan", "Qwen3-8B", "--strategy", "p1xd1", "--device", "h100-80g")
    assert "prefill pool: dp0; decode pool: dp1" in " ".join(text.stdout.split())


def test_pools_over_nodes_name_the_kv_server_for_the_decode_ranks_away():
    """On two nodes of 4 GPUs, p1xd2xtp2 puts dp0 and dp1 on the head and dp2 on the second
    node: dp1 reads the head's tier, dp2 fetches over the authenticated TCP link."""
    result = cli_in_process("plan", "Qwen3-8B", "--strategy", "p1xd2xtp2", "--device",
                            "h100-80g", "--devices", "8", "--nodes", "2", "--json")
    assert result.exit_code == 0, result.stdout
    doc = json.loads(result.stdout)
    assert {(m["engine"], m["node"]) for m in doc["mesh"]} == {(0, 0), (1, 0), (2, 1)}
    assert doc["pools"]["kv_link"] == (
        "the node's host KV tier (shared memory); for dp2 on other nodes, the head's KV server "
        "over TCP (ZMQ, CURVE) into their node's tier")

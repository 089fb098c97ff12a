"""`parashift plan` with KV tiers (issue 53): the host and disk tiers' blocks and tokens per
node, equal to what a real HostArena and DiskTier of that size and slot hold."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from conftest import cli_in_process

from parashift.kv_tiers.disk_tier import DiskTier
from parashift.kv_tiers.host_arena import HostArena
from parashift.kv_tiers.shm_files import shm_path
from parashift.plan.estimate import PlanSettings, make_plan
from parashift.plan.hardware import DEVICES, GiB
from parashift.plan.presets import PRESETS
from parashift.strategies.spec import StrategySpec

MiB = 2**20


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps lines at the terminal's width


def _arena_slots(size: int, slot_bytes: int) -> int:
    arena = HostArena.open(shm_path(f"parashift-test-plan-{uuid.uuid4().hex}"), size,
                           slot_bytes, owner=True)
    try:
        return arena.num_slots
    finally:
        arena.close()


def _disk_blocks(tmp_path, size: int, slot_bytes: int) -> int:
    return DiskTier(str(tmp_path / "disk"), size, bytes(32), slot_bytes, writer=True).capacity


def test_tiers_hold_what_the_real_arena_and_disk_tier_hold(tiny_llama, tmp_path):
    # dp2xtp2 in fp32: a worker holds 2 layers x K and V x 16 tokens x 1 of the 2 kv heads x
    # 16 dims x 4 bytes; a slot holds a block of each of the engine's 2 workers.
    slot_bytes = 2 * (2 * 2 * 16 * 1 * 16 * 4)
    disk_dir = str(tmp_path / "kv")
    flags = ["plan", tiny_llama, "--strategy", "dp2xtp2", "--device", "cpu", "--dtype", "fp32",
             "--max-model-len", "256", "--kv-offloading-size", "1MiB", "--kv-disk-dir",
             disk_dir, "--kv-disk-size", "3MiB"]
    done = cli_in_process(*flags, "--json")
    assert done.exit_code == 0, done.output
    tiers = json.loads(done.stdout)["kv_tiers"]
    host_blocks = _arena_slots(MiB, slot_bytes)
    disk_blocks = _disk_blocks(tmp_path, 3 * MiB, slot_bytes)
    assert host_blocks == 112  # 8 sets of 16 less the set the index takes
    assert tiers["host"] == {"size_bytes": MiB, "slot_bytes": slot_bytes,
                             "blocks": host_blocks, "tokens": host_blocks * 16}
    assert tiers["disk"] == {"size_bytes": 3 * MiB, "slot_bytes": slot_bytes,
                             "blocks": disk_blocks, "tokens": disk_blocks * 16}
    assert tiers["disk_dir"] == disk_dir and tiers["engines_per_node"] == 2
    assert not os.path.exists(disk_dir)  # a dry run makes nothing
    text = _flat(cli_in_process(*flags).stdout)
    assert (f"KV host tier per node: 0.00 GiB = {host_blocks} blocks = {host_blocks * 16:,} "
            "tokens, shared by the node's 2 engines") in text
    assert (f"KV disk tier per node: 0.00 GiB = {disk_blocks} blocks = {disk_blocks * 16:,} "
            f"tokens in {disk_dir} (warm across restarts)") in text


def test_a_slot_is_as_wide_as_the_largest_stage_times_the_workers():
    # Llama-3.1-8B pp3: 32 layers as 11, 11, 10; a worker's block is 11 layers x K and V x
    # 16 tokens x 8 kv heads x 128 dims x 2 bytes, and a slot holds 3 of them.
    size = GiB
    p = make_plan(PRESETS["Llama-3.1-8B"], StrategySpec.parse("pp3"),
                  PlanSettings(DEVICES["h100-80g"], 3, kv_offloading_size=size))
    slot_bytes = 3 * (11 * 2 * 16 * 8 * 128 * 2)
    host_blocks = _arena_slots(size, slot_bytes)
    assert p.fits and p.kv_tiers.host.slot_bytes == slot_bytes
    assert p.kv_tiers.host.blocks == host_blocks
    assert p.kv_tiers.host.tokens == host_blocks * 16
    assert p.kv_tiers.disk is None and p.kv_tiers.engines_per_node == 1


def test_without_tiers_none_are_shown():
    done = cli_in_process("plan", "Llama-3.1-8B", "--device", "h100-80g", "--json")
    assert json.loads(done.stdout)["kv_tiers"] is None
    done = cli_in_process("plan", "Llama-3.1-8B", "--device", "h100-80g")
    assert done.exit_code == 0 and "KV host tier" not in done.stdout


def test_a_host_tier_below_one_set_does_not_fit_as_the_engine_refuses_it():
    p = make_plan(PRESETS["Llama-3.1-8B"], StrategySpec.parse("tp1"),
                  PlanSettings(DEVICES["h100-80g"], 1, kv_offloading_size=16 * MiB))
    slot_bytes = p.kv_tiers.host.slot_bytes
    with pytest.raises(ValueError) as refused:
        _arena_slots(16 * MiB, slot_bytes)
    [error] = p.errors
    said, least = error.split(": give it at least ")
    assert said == str(refused.value).split(": give it at least ")[0]
    assert _arena_slots(int(float(least.removesuffix(" MiB")) * MiB), slot_bytes) == 16


@pytest.mark.parametrize("args, message", [
    (["--kv-disk-dir", "/tmp/kv"], "--kv-disk-dir and --kv-disk-size go together"),
    (["--kv-disk-dir", "/tmp/kv", "--kv-disk-size", "2"],
     "--kv-disk-dir needs --kv-offloading-size"),
])
def test_tier_flags_are_checked_as_the_engines_config_checks_them(args, message):
    result = cli_in_process("plan", "Llama-3.1-8B", "--device", "h100-80g", *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr

"""`--strategy auto` plans on the device the launch resolves (--device; without it a GPU where
one is visible, else the CPU), with the settings `plan` gives the same flags."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import cli_in_process

from parashift.engine.args import EngineArgs
from parashift.plan import this_machine
from parashift.plan.hardware import DEVICES
from parashift.plan.settings import Hardware, dry_run_settings
from parashift.plan.this_machine import auto_inputs


@pytest.fixture
def eight_h100s(monkeypatch):
    """This machine as torch and nvidia-smi would see it with eight H100s."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(this_machine, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")


def test_without_device_the_visible_gpus_are_planned_on(tiny_llama, eight_h100s):
    _, settings = auto_inputs(EngineArgs(tiny_llama, strategy="auto"))
    assert (settings.device.name, settings.devices, settings.cpu_ids) == ("h100-80g", 8, None)


def test_device_cpu_plans_on_this_machines_cores_beside_gpus(tiny_llama, eight_h100s):
    cores = tuple(sorted(os.sched_getaffinity(0)))
    _, settings = auto_inputs(EngineArgs(tiny_llama, strategy="auto", device="cpu"))
    assert (settings.device.name, settings.devices, settings.cpu_ids) == ("cpu", len(cores),
                                                                          cores)


def test_device_cuda_without_a_gpu_is_refused_as_run_refuses_it(tiny_llama, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="--device cuda: no GPU is visible"):
        auto_inputs(EngineArgs(tiny_llama, strategy="auto", device="cuda"))
    result = cli_in_process("generate", tiny_llama, "--prompt", "x", "--strategy", "auto",
                            "--device", "cuda")
    assert result.exit_code == 2 and "--device cuda: no GPU is visible" in result.stderr


@pytest.mark.parametrize("flags", [{}, {"dtype": "float32", "max_num_seqs": 8,
                                        "kv_cache_memory": 32 << 20, "gemm_paths": "linear"}])
def test_auto_ranks_with_the_settings_plan_gives_the_same_flags(tiny_llama, flags):
    """create_config's resolution (auto) and plan's dry run of the same flags agree."""
    args = EngineArgs(tiny_llama, strategy="auto", device="cpu", **flags)
    shape, settings = auto_inputs(args)
    cores = len(os.sched_getaffinity(0))
    assert settings == dry_run_settings(args, shape, Hardware(DEVICES["cpu"]), cores)

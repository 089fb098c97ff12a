"""`--strategy auto` for `parashift run` and `generate`: `plan --auto` on the devices this
machine has of the device the launch resolves (--device; without it a GPU when one is visible,
else the CPU), with the config create_config resolves from the engine's flags, and the winner
that runs today. The same ranking as `parashift plan MODEL --auto --devices N --device D` with
those flags."""

from __future__ import annotations

import os
import subprocess

from parashift.engine.args import EngineArgs, create_config
from parashift.plan.auto import rank_plans
from parashift.plan.estimate import Plan, PlanSettings
from parashift.plan.hardware import DEVICES, Device
from parashift.plan.load_shape import load_shape
from parashift.plan.settings import machine_settings
from parashift.plan.shape import ModelShape
from parashift.strategies.spec import StrategySpec

# Substrings of the GPU's name, most specific first (GH200 is no H200: no profile).
_GPU_NAMES = {"GH200": None, "H200": "h200-141g", "H100": "h100-80g", "B200": "b200-180g",
              "L40S": "l40s-48g", "A100-SXM4-80GB": "a100-80g", "A100 80GB": "a100-80g",
              "A100": "a100-40g"}


def _gpu_name() -> str:
    """From nvidia-smi, not torch: asking torch would open a CUDA context in the launcher,
    on GPU 0, for the whole run."""
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        done = subprocess.run(query, capture_output=True, text=True,  # nosec B603
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.splitlines()[0].strip() if done.returncode == 0 and done.stdout else ""


def this_machine(device: str) -> tuple[Device, int]:
    """The plan profile of the resolved `device` on this machine, and how many: CUDA GPUs by
    name, or this process's CPU cores."""
    if device == "cpu":
        return DEVICES["cpu"], len(os.sched_getaffinity(0))
    import torch

    count = torch.cuda.device_count()
    if count < 1:  # as a launch on this machine refuses it (engine/placement.py)
        raise ValueError(f"--device {device}: no GPU is visible")
    name = _gpu_name()
    profile = next((v for k, v in _GPU_NAMES.items() if k in name), None)
    if profile is None:
        raise ValueError(f"--strategy auto: no plan profile for the GPU {name!r}; give "
                         "--strategy explicitly (see parashift plan --auto --device)")
    return DEVICES[profile], count


def auto_inputs(args: EngineArgs) -> tuple[ModelShape, PlanSettings]:
    """The model's shape and the settings `--strategy auto` ranks the strategies with: the
    config as the launch resolves it (device, dtype, limits: what no strategy changes, so it is
    resolved for one engine of one worker), on this machine's devices of its kind."""
    config = create_config(args, StrategySpec.from_sizes())
    device, count = this_machine(config.device.device)
    return load_shape(args.model), machine_settings(config, device, count)


def choose_strategy(args: EngineArgs, objective: str, one_engine: bool = False
                    ) -> tuple[StrategySpec, list[Plan], str]:
    """The winner that runs today, every plan that fits (best first), and why. `one_engine`:
    offline generation, which runs a single engine (no dp axis)."""
    shape, settings = auto_inputs(args)
    plans, why = rank_plans(shape, settings, objective)
    if one_engine:
        plans = [p for p in plans if p.spec.processes().num_engines == 1]
    runnable = [p for p in plans if p.runnable]
    if not runnable:
        raise ValueError(f"--strategy auto: {why}")
    return runnable[0].spec, plans, why


def describe(plans: list[Plan], chosen: StrategySpec, limit: int = 4) -> str:
    """The choice and the runners-up, with their predicted figures."""
    lines = [f"--strategy auto chose {chosen} (of {len(plans)} that fit):"]
    for p in plans[:limit]:
        e = p.estimate
        mark = "->" if p.spec == chosen else "  "
        lines.append(f"  {mark} {str(p.spec):<14} decode {e['decode_tokens_per_s']:>10,.0f} "
                     f"tok/s, TPOT {e['tpot_ms']:.2f} ms (one sequence "
                     f"{e['tpot_single_ms']:.2f} ms){'' if p.runnable else ', not runnable yet'}")
    return "\n".join(lines)

"""`--strategy auto` for `parashift run` and `generate`: `plan --auto` on the devices this
machine has (its GPUs, or on CPU its cores), with the engine's own flags, and the winner that
runs today. The same ranking as `parashift plan MODEL --auto --devices N --device D` with
those flags."""

from __future__ import annotations

import os
import subprocess

from parashift.defaults import DTYPE_BYTES, resolve_dtype_name
from parashift.engine.args import EngineArgs, gemm_paths
from parashift.plan.auto import rank_plans
from parashift.plan.estimate import Plan, PlanSettings, keeps_shared_weight_copies
from parashift.plan.hardware import DEVICES, INTER_NODE
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


def this_machine() -> tuple[str, int]:
    """(plan's device name, how many): CUDA GPUs by name, else this process's CPU cores."""
    import torch

    if torch.cuda.is_available():
        name = _gpu_name()
        device = next((v for k, v in _GPU_NAMES.items() if k in name), None)
        if device is None:
            raise ValueError(f"--strategy auto: no plan profile for the GPU {name!r}; give "
                             "--strategy explicitly (see parashift plan --auto --device)")
        return device, torch.cuda.device_count()
    return "cpu", len(os.sched_getaffinity(0))


def machine_settings(args: EngineArgs, checkpoint_dtype: str | None) -> PlanSettings:
    device, count = this_machine()
    is_gpu = DEVICES[device].is_gpu
    dtype = resolve_dtype_name(args.dtype, checkpoint_dtype, "cuda" if is_gpu else "cpu")
    return PlanSettings(
        DEVICES[device], count, 1, None, INTER_NODE["ib"], args.max_model_len,
        DTYPE_BYTES[dtype], args.gpu_memory_utilization, args.kv_cache_memory, None,
        args.block_size, args.max_num_seqs,
        cpu_ids=None if is_gpu else tuple(sorted(os.sched_getaffinity(0))),
        quantization=args.quantization,
        # (--gemm-paths linear leaves a tied head on the embedding's own weight)
        shared_weight_copies=keeps_shared_weight_copies(is_gpu, dtype)
        and gemm_paths(args.gemm_paths, args.cpu_kernels) != ("linear",))


def choose_strategy(args: EngineArgs, objective: str, one_engine: bool = False
                    ) -> tuple[StrategySpec, list[Plan], str]:
    """The winner that runs today, every plan that fits (best first), and why. `one_engine`:
    offline generation, which runs a single engine (no dp axis)."""
    from parashift.plan.cli import load_shape

    shape = load_shape(args.model)
    settings = machine_settings(args, shape.checkpoint_dtype)
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

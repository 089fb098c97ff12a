"""The Ray cluster as both `parashift run --backend ray` and `parashift plan --backend ray`
see it: what one data-parallel rank asks for (its placement-group bundles), joining or
starting a cluster, and refusing a cluster too small for the strategy. Light on purpose (Ray
is imported only when used, torch never), so that the planner stays fast."""

from __future__ import annotations

import math
import os

from parashift.strategies.layout import ProcessPlan

# Ray must keep to 127.0.0.1 on a machine without a cluster network, in every process.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


class RayStartupError(ValueError):
    """The cluster cannot hold the strategy (a user error, reported like a bad flag)."""


def rank_bundles(processes: ProcessPlan, gpu: bool) -> list[dict[str, float]]:
    """One engine's bundles, from the strategy's `processes` hook: the engine core, then one
    per worker. An engine without workers of its own runs the model in its own bundle."""
    workers = processes.workers_per_engine
    if workers == 1:
        return [{"CPU": 1.0, "GPU": 1.0} if gpu else {"CPU": 1.0}]
    return [{"CPU": 1.0}] + [{"GPU": 1.0} if gpu else {"CPU": 1.0}] * workers


def bundle_totals(bundles: list[dict[str, float]], num_ranks: int = 1) -> dict[str, float]:
    """CPUs and GPUs that `num_ranks` ranks of these bundles take in all."""
    return {k: num_ranks * sum(b.get(k, 0.0) for b in bundles) for k in ("CPU", "GPU")}


def import_ray():
    """Ray, with this project's environment set first (and a clear error without it)."""
    os.environ.update({k: os.environ.get(k, v) for k, v in RAY_ENV.items()})
    try:
        import ray
    except ImportError:
        raise RayStartupError("--backend ray needs Ray: pip install 'parashift[ray]'") from None
    return ray


def connect(address: str | None, bundles: list[dict[str, float]], num_ranks: int) -> bool:
    """Joins the cluster at `address` / RAY_ADDRESS, or starts a local one sized for the
    strategy. Returns whether this process started it (and must stop it)."""
    ray = import_ray()
    address = address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": dict(RAY_ENV)}
    if address:
        try:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        except ConnectionError as e:
            raise RayStartupError(f"--ray-address {address}: {e}") from None
        return False
    need = bundle_totals(bundles, num_ranks)
    ray.init(address="local", num_cpus=math.ceil(need["CPU"]), num_gpus=math.ceil(need["GPU"]),
             include_dashboard=False,
             runtime_env=runtime_env, log_to_driver=True)
    return True


def check_capacity(strategy: str, bundles: list[dict[str, float]], num_ranks: int) -> None:
    import ray

    free = ray.available_resources()
    need = bundle_totals(bundles, num_ranks)
    if all(v <= free.get(k, 0.0) + 1e-9 for k, v in need.items()):
        return
    workers = num_ranks * (len(bundles) - 1) if len(bundles) > 1 else num_ranks
    kind = "GPU" if bundles[-1].get("GPU") else "CPU"
    raise RayStartupError(
        f"{strategy} needs {workers} {kind} worker bundle(s) + {num_ranks} engine "
        f"bundle(s): {need['CPU']:g} CPUs and {need['GPU']:g} GPUs; the cluster has "
        f"{free.get('CPU', 0.0):g} CPUs and {free.get('GPU', 0.0):g} GPUs free")

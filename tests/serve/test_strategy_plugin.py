"""A strategy plugin changes a real launch: a package that registers, through the entry point,
a data-parallel axis keeping core 0 for the API server. `plan` shows that placement and `run`
launches exactly it (read back from the processes' names and affinities)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
from conftest import install_strategy_plugin

from .servers import running_server

PLUGIN = '''
import dataclasses

from parashift.strategies.data import DataParallel


class ApiCoreDataParallel(DataParallel):
    """Data parallel that leaves the first core to the API server."""

    def processes(self, plan):
        return dataclasses.replace(super().processes(plan), reserved_cpus=1)
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> str:
    """Installed the way pip would: a module plus dist-info naming the entry point."""
    return install_strategy_plugin(tmp_path_factory.mktemp("plugin"), "api_core_plugin",
                                   PLUGIN, "dp", "ApiCoreDataParallel")


def _env(plugin_path: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([plugin_path, os.environ.get("PYTHONPATH", "")])}


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


@pytest.mark.slow
def test_the_plugin_placement_is_planned_and_launched(tiny_llama, plugin_path):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one for the API server, the rest for the engines")
    done = subprocess.run([sys.executable, "-m", "parashift.cli", "plan", tiny_llama,
                           "--strategy", "dp2", "--device", "cpu", "--json"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **_env(plugin_path)})
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["api_server_cpus"] == cores[:1]
    planned = {r["process_name"]: r["cpu_ids"] for r in doc["mesh"]}
    rest = cores[1:]
    assert set(planned) == {"parashift-engine-dp0", "parashift-engine-dp1"}
    assert all(set(ids) <= set(rest) for ids in planned.values())

    with running_server(tiny_llama, "--strategy", "dp2", "--dtype", "float32",
                        "--max-model-len", "256", "--kv-cache-memory", "32MiB",
                        env=_env(plugin_path)) as server:
        launched = {}
        for proc in server.current_tree():
            line = _cmdline(proc)
            for name in [*planned, "parashift-api-0"]:
                if line.startswith(name):
                    launched[name] = sorted(proc.cpu_affinity())
        assert launched.pop("parashift-api-0") == cores[:1]
        assert launched == planned
        status, body = server.request("POST", "/v1/completions", {
            "model": server.model_name, "prompt": "hi", "max_tokens": 4})
        assert status == 200, body

"""`parashift run --backend ray`: engine cores (and tp workers) as Ray actors in one placement
group per rank, on a local Ray cluster the launcher starts (or one the test starts)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from .servers import TINY_ARGS, live, running_server
from .test_data_parallel import PROMPTS, complete, greedy_texts, routed
from .test_elastic_dp import KEY, scale

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@pytest.fixture(autouse=True)
def ray_env(monkeypatch):
    for key, value in RAY_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def ray_processes() -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(proc.info["cmdline"] or [])
            if "raylet" in cmd or "gcs_server" in cmd:
                out.append(proc)
    return live(out)


def stranger_gets_nothing(address: str) -> bool:
    """A plain ZMQ peer (no cluster secret) says Hello to `address`: no answer comes back."""
    import zmq

    from parashift.wire import protocol as p

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(p.encode(p.Hello(0, 1)))
        return not sock.poll(1500)
    finally:
        ctx.destroy(linger=0)


def find(server, name: str) -> psutil.Process:
    for proc in psutil.process_iter(["cmdline", "name"]):
        with contextlib.suppress(psutil.Error):
            if name in (proc.info["name"] or "") or name in " ".join(proc.info["cmdline"] or []):
                return proc
    raise AssertionError(f"no {name} process:\n" + server.output()[-3000:])


@pytest.mark.parametrize("strategy", [pytest.param("dp2", marks=pytest.mark.extended),
                                      "dp2xtp2",
                                      pytest.param("dp2xpp2", marks=pytest.mark.extended)])
def test_ray_backend_serves_like_mp(tiny_llama, strategy):
    expected = greedy_texts(tiny_llama)
    assert ray_processes() == []
    with running_server(tiny_llama, *TINY_ARGS, "--backend", "ray", "--strategy", strategy) as s:
        assert "placement group" in s.output()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            bodies = list(pool.map(lambda p: complete(s, p), PROMPTS))
        assert [b["choices"][0]["text"] for b in bodies] == expected
        assert routed(s, 0) > 0 and routed(s, 1) > 0
        for rank in (0, 1):  # structured outputs: the mask reaches the sampling actor
            status, raw = s.request("POST", "/v1/completions", {
                "prompt": "x", "max_tokens": 20, "temperature": 1.0, "structured_outputs": {
                    "regex": "[a-c]{4}"}}, {"X-data-parallel-rank": str(rank)})
            choice = json.loads(raw)["choices"][0]
            assert status == 200 and re.fullmatch("[a-c]{4}", choice["text"]), raw
        if strategy != "dp2":  # one actor per worker bundle, named for its mesh coordinates
            find(s, {"dp2xtp2": "ParashiftWorkerDp1Tp1", "dp2xpp2": "ParashiftWorkerDp1Pp1"}[
                strategy])
        # No user-given secret, yet every tcp socket of the launch is CURVE: a stranger
        # connecting to any of them gets nothing back.
        http_port = int(s.url.rsplit(":", 1)[1])
        tree = [proc for proc in [psutil.Process(s.proc.pid),
                                  *psutil.Process(s.proc.pid).children(recursive=True)]
                if "parashift" in " ".join(proc.cmdline()) + proc.name()]  # not Ray's own
        listening = {(c.laddr.ip, c.laddr.port) for proc in tree
                     for c in proc.net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port != http_port}
        assert listening, "no internal tcp socket found"
        # Each on the node's address, the tp rendezvous store too, none on every interface.
        assert not [a for a in listening if a[0] in ("0.0.0.0", "::")], listening
        for ip, port in listening:
            assert stranger_gets_nothing(f"tcp://{ip}:{port}"), (ip, port)
        assert s.get_json("/health")[0] == 200
        # An engine actor killed under load: its rank is reported, the other one serves.
        find(s, "ParashiftEngineDp1").send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 20
        while s.get_json("/health")[0] != 503:
            assert time.monotonic() < deadline, "the dead actor went unnoticed:\n" + s.output()
            time.sleep(0.2)
        assert "dp1" in s.get_json("/health")[1]["detail"]
        for prompt, want in zip(PROMPTS[:4], expected[:4], strict=True):
            assert complete(s, prompt)["choices"][0]["text"] == want
    deadline = time.monotonic() + 30  # the launcher's local cluster is gone with it
    while ray_processes():
        assert time.monotonic() < deadline, ray_processes()
        time.sleep(0.5)


def test_an_existing_cluster_too_small_planned_scaled_and_left_clean(tiny_llama):
    """A cluster started like a user would (`ray start --head --num-cpus 3`): dp2xtp2 is
    refused at once naming what is missing, `plan --backend ray` places dp2 on its node; a dp2
    server that may grow to 4 grows to 3 (a new placement group whose rank serves), is refused
    a 4th rank the cluster's CPUs cannot hold, shrinks to 1 (the leaving ranks' actors and
    groups removed) and leaves no actor or placement group behind."""
    env = {**os.environ, **RAY_ENV}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    start = subprocess.run([ray_cli, "start", "--head", "--num-cpus", "3", "--port", "0",
                            "--include-dashboard", "false"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert start.returncode == 0, start.stderr
    cli = [sys.executable, "-m", "parashift.cli"]
    try:
        began = time.monotonic()
        done = subprocess.run(
            [*cli, "run", tiny_llama, *TINY_ARGS, "--port", "0", "--backend",
             "ray", "--ray-address", "auto", "--strategy", "dp2xtp2"],
            capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 2, done.stderr[-3000:]
        assert "dp2xtp2 needs 4 CPU worker bundle(s) + 2 engine bundle(s)" in done.stderr
        assert "the cluster has 3 CPUs" in done.stderr
        assert time.monotonic() - began < 60

        plan = subprocess.run([*cli, "plan", tiny_llama, "--strategy", "dp2", "--backend",
                               "ray", "--ray-address", "auto", "--json"],
                              capture_output=True, text=True, timeout=120, env=env)
        placement = json.loads(plan.stdout)["ray_placement"]
        assert [p["node"] is not None for p in placement] == [True, True], plan.stdout

        expected = greedy_texts(tiny_llama)
        with running_server(tiny_llama, *TINY_ARGS, "--backend", "ray", "--ray-address",
                            "auto", "--strategy", "dp2", "--data-parallel-size-max", "4",
                            "--admin-api-key", KEY) as s:
            assert complete(s, PROMPTS[0])["choices"][0]["finish_reason"] == "length"
            assert scale(s, 3) == (200, {"data_parallel_size": 3})
            assert s.get_json("/health")[1]["ranks"] == {
                "dp0": "serving", "dp1": "serving", "dp2": "serving"}
            assert complete(s, PROMPTS[1], rank=2)["choices"][0]["text"] == expected[1]
            status, body = scale(s, 4)
            assert status == 409 and "the Ray cluster has 0 CPUs" in body["error"]["message"]
            assert scale(s, 1) == (200, {"data_parallel_size": 1})
            assert s.get_json("/health")[1]["ranks"] == {"dp0": "serving"}
            assert ray_state(env) == {"groups": ["parashift-dp0"],
                                      "actors": ["ParashiftEngineDp0"]}
            assert complete(s, PROMPTS[2])["choices"][0]["text"] == expected[2]
        assert ray_state(env) == {"groups": [], "actors": []}
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120, env=env)


# From the GCS tables (the state API would need the dashboard, which these clusters skip).
RAY_STATE = """
import json, ray
ray.init(address="auto", log_to_driver=False)
groups = [g["name"] for g in ray.util.placement_group_table().values()
          if g["state"] != "REMOVED"]
actors = [a["ActorClassName"].rsplit(".", 1)[-1] for a in ray._private.state.actors().values()
          if a["State"] != "DEAD"]
print(json.dumps({"groups": sorted(groups), "actors": sorted(actors)}))
"""


def ray_state(env: dict) -> dict:
    """The live placement groups and actors of the cluster at RAY_ADDRESS=auto, by name."""
    check = subprocess.run([sys.executable, "-c", RAY_STATE], capture_output=True, text=True,
                           timeout=120, env=env)
    assert check.returncode == 0, check.stderr[-2000:]
    return json.loads(check.stdout.strip().splitlines()[-1])


def test_ray_backend_runs_expert_parallel_over_engine_actors(mixtral):
    """--backend ray --strategy dp2xep: the engine actors meet at the launcher's expert
    store (tcp on the node's address, CURVE under the launch's own secret) and give what one
    engine holding every expert gives; a stranger on the store's port gets nothing."""
    from .test_expert_parallel import ARGS as EP_ARGS
    from .test_expert_parallel import assert_matches, reference

    expected = reference(mixtral)
    with running_server(mixtral, *EP_ARGS, "--backend", "ray", "--strategy", "dp2xep") as s:
        store = re.search(r"expert group's store listens at (tcp://\S+)", s.output()).group(1)
        assert_matches(s, expected, [0, 1])
        assert stranger_gets_nothing(store)
        assert_matches(s, expected, [1])  # dp0 runs only dummy steps

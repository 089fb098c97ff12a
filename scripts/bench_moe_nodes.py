"""`python scripts/bench_moe_nodes.py`: expert parallel over two nodes on loopback, and the
prefill cadence, on a random-weight Mixtral-shaped MoE (issue 58). Three servers, alternated
--rounds times, one at a time, on the same workload as scripts/bench_pd.py (--streams clients
each keep a stream in progress while --prompt-len-token prompts arrive as a Poisson process):

- `dp2xep`: one launcher, both ranks on this node;
- `dp2xep --prefill-schedule-interval 2`: the same, prefills held to even steps of a wave;
- `dp2xep over 2 nodes`: a head with dp0 and a `--headless` launcher with dp1 (its own
  process tree), meeting over TCP under the cluster secret as two machines would. Each tree
  is held to its half of this machine's cores (as one node's dp2xep gives each rank half):
  two launchers would otherwise both lay their rank out over every core.

Per server: the streams' inter-token latency p50 / p99 / p99.9, output tok/s, the long
prompts' TTFT, and the expert dispatch's share of a lockstep step (dispatch and combine
seconds over step seconds, from /metrics, both ranks).

    python scripts/bench_moe_nodes.py [--rounds 3] [--streams 4] [--prompt-rate 1]
        [--servers "dp2xep,dp2xep N=2"]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import threading
import time

from bench_pd import VOCAB, alternate, metric
from random_model import random_mixtral
from study_server import ServerProcess, running_server, stop_server

SECRET = "bench-moe-nodes-secret-0123456789"
COMMON = ["--strategy", "dp2xep", "--max-model-len", "2048"]


@contextlib.contextmanager
def two_nodes(model: str, args: list[str]):
    """A head (dp0, the API server) and a headless launcher (dp1) on 127.0.0.1."""
    env = {**os.environ, "PARASHIFT_CLUSTER_SECRET": SECRET}
    cores = sorted(os.sched_getaffinity(0))
    halves = [set(cores[: len(cores) // 2]), set(cores[len(cores) // 2 :])]
    base = [sys.executable, "-m", "parashift.cli", "run", model, *args,
            "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1"]
    head = subprocess.Popen([*base, "--host", "127.0.0.1", "--port", "0",  # nosec B603
                             "--enable-admin-routes", "--data-parallel-rpc-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, preexec_fn=lambda: os.sched_setaffinity(0, halves[0]))
    server, node = ServerProcess("", head), None
    lines: list[str] = server.lines

    def drain() -> None:
        for line in head.stdout:
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()

    def wait_for(pattern: str) -> re.Match:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and head.poll() is None:
            for line in list(lines):
                if m := re.search(pattern, line):
                    return m
            time.sleep(0.1)
        raise RuntimeError("the head did not start:\n" + "".join(lines[-40:]))

    try:
        port = wait_for(r"handshake listens at tcp://127\.0\.0\.1:(\d+)")[1]
        node = subprocess.Popen([*base, "--headless", "--data-parallel-start-rank", "1",  # nosec B603
                                 "--data-parallel-rpc-port", port],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                preexec_fn=lambda: os.sched_setaffinity(0, halves[1]))
        server.url = wait_for(r"is serving .* at (http://\S+)/v1")[1]
        yield server
    finally:
        stop_server(server)
        if node is not None:
            node.terminate()
            node.wait(60)


def dispatch_share(url: str) -> float:
    seconds = [metric(url, name, f'engine="dp{r}"') for r in (0, 1)
               for name in ("parashift_expert_dispatch_seconds",
                            "parashift_lockstep_step_seconds")]
    return (seconds[0] + seconds[2]) / max(seconds[1] + seconds[3], 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-out", type=int, default=128)
    ap.add_argument("--stream-turns", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--prompt-out", type=int, default=8)
    ap.add_argument("--prompt-rate", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--servers", default="dp2xep,dp2xep N=2,dp2xep over 2 nodes",
                    help="which of the three, comma-separated")
    ap.add_argument("--out", default=None, help="a JSON file for every run")
    a = ap.parse_args()
    model = random_mixtral(hidden=512, intermediate=1024, layers=4, heads=8, kv_heads=4,
                           experts=8, top_k=2, vocab=VOCAB)
    servers = {
        "dp2xep": lambda: running_server(model, COMMON),
        "dp2xep N=2": lambda: running_server(model, [*COMMON,
                                                     "--prefill-schedule-interval", "2"]),
        "dp2xep over 2 nodes": lambda: two_nodes(model, COMMON),
    }
    chosen = a.servers.split(",")
    if unknown := set(chosen) - set(servers):
        ap.error(f"--servers: unknown {sorted(unknown)}; choose from {list(servers)}")
    alternate(a, {name: servers[name] for name in chosen},
              lambda url: {"dispatch_share": dispatch_share(url)})


if __name__ == "__main__":
    main()

"""`parashift run --strategy auto` on CPU launches what `parashift plan --auto --json` ranks
first (of those that run today) on the same inputs: this machine's cores and the run's flags;
it prints the choice and the runners-up."""

import json
import os
import subprocess
import sys

from .servers import TINY_ARGS, running_server


def test_strategy_auto_launches_the_plans_winner(tiny_llama):
    cores = len(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, "-m", "parashift.cli", "plan", tiny_llama, "--auto",
                           "--json", "--device", "cpu", "--devices", str(cores), *TINY_ARGS],
                          capture_output=True, text=True, timeout=120, check=True)
    ranking = json.loads(done.stdout)["ranking"]
    winner = next(r["strategy"] for r in ranking if r["runnable"])
    with running_server(tiny_llama, *TINY_ARGS, "--strategy", "auto") as s:
        assert f"--strategy auto chose {winner} (of {len(ranking)} that fit)" in s.output()
        for r in ranking[:2]:
            assert r["strategy"] in s.output()  # the runners-up, with their figures
        status, raw = s.request("POST", "/v1/completions", {"prompt": [1, 2, 3],
                                                            "max_tokens": 3})
        assert status == 200, raw
        names = {p.name() for p in s.current_tree() if p.is_running()}
        layout = {"dp2": "parashift-engine-dp1", "tp2": "parashift-worker-dp0-tp1",
                  "pp2": "parashift-worker-dp0-pp1-tp0"}
        if winner in layout:
            assert layout[winner] in names, names

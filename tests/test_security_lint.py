"""bandit, the security linter, finds nothing in the package and the kernels: every finding is
fixed or tagged on its line (the tags' reasons: pyproject.toml, [tool.bandit])."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bandit_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "bandit", "-q", "-c", "pyproject.toml", "-r",
                           "src", "kernels"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]

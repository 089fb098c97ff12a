"""The package layers of DESIGN.md, as import-linter contracts in pyproject.toml: they hold for
the tree, and a module that imports upwards breaks them (so the check can fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import parashift

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--config", os.path.join(ROOT, "pyproject.toml"),
        "--no-cache"]


def _lint(package_parent: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=package_parent)
    return subprocess.run(LINT, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_the_tree_keeps_the_layers():
    result = _lint(os.path.dirname(os.path.dirname(parashift.__file__)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "package layers KEPT" in result.stdout


def test_an_upward_import_breaks_them(tmp_path):
    src = os.path.dirname(parashift.__file__)
    copy = tmp_path / "parashift"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    # The executor must never reach up into the HTTP layer.
    (copy / "executor" / "bad_upward.py").write_text(
        "from parashift.serve import api_server  # noqa: F401\n")
    result = _lint(str(tmp_path))
    assert result.returncode != 0
    assert "package layers BROKEN" in result.stdout
    assert "parashift.executor.bad_upward -> parashift.serve.api_server" in result.stdout

"""The package layers of DESIGN.md, as import-linter contracts in pyproject.toml: they hold for
the tree, and a module that imports upwards breaks them (so the check can fail)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import parashift

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--config", os.path.join(ROOT, "pyproject.toml"),
        "--no-cache"]


def _lint(package_parent: str, kernels_parent: str = ROOT) -> subprocess.CompletedProcess:
    """import-linter over parashift (in `package_parent`) and kernels/ (in `kernels_parent`,
    as the top-level package it is in the tree)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_parent, kernels_parent]))
    # import-linter puts its working directory first on sys.path: the kernels' folder
    return subprocess.run(LINT, capture_output=True, text=True, env=env, cwd=kernels_parent,
                          timeout=120)


def test_the_tree_keeps_the_layers():
    result = _lint(os.path.dirname(os.path.dirname(parashift.__file__)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "package layers KEPT" in result.stdout and "kernels are a leaf KEPT" in result.stdout


def test_a_kernel_that_imports_parashift_breaks_the_leaf(tmp_path):
    shutil.copytree(os.path.join(ROOT, "kernels"), tmp_path / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "kernels" / "bad_leaf.py").write_text("import parashift.config  # noqa\n")
    result = _lint(os.path.dirname(os.path.dirname(parashift.__file__)), str(tmp_path))
    assert result.returncode != 0
    assert "kernels are a leaf BROKEN" in result.stdout
    assert "kernels.bad_leaf -> parashift.config" in result.stdout


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


# Strongly connected components of the module import graph (grimp, which import-linter is
# built on, sees function-local imports too; TYPE_CHECKING ones count here, as a cycle of
# annotations is a cycle all the same), printed as JSON: every cycle between modules, whatever
# layer it sits in.
CYCLES = """
import json, sys
import grimp
graph = grimp.build_graph("parashift", "kernels", exclude_type_checking_imports=False,
                          cache_dir=None)
edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
index, low, stack, on_stack, found = {}, {}, [], set(), []
def visit(root):
    work = [(root, iter(sorted(edges[root])))]
    index[root] = low[root] = len(index); stack.append(root); on_stack.add(root)
    while work:
        node, children = work[-1]
        child = next(children, None)
        if child is None:
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop(); on_stack.discard(m); component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
        elif child not in index:
            index[child] = low[child] = len(index); stack.append(child); on_stack.add(child)
            work.append((child, iter(sorted(edges[child]))))
        elif child in on_stack:
            low[node] = min(low[node], index[child])
for module in sorted(edges):
    if module not in index:
        visit(module)
print(json.dumps(sorted(found)))
"""


def _cycles(package_parent: str) -> list[list[str]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_parent, ROOT]))
    result = subprocess.run([sys.executable, "-c", CYCLES], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_no_module_imports_itself_through_others():
    assert _cycles(os.path.dirname(os.path.dirname(parashift.__file__))) == []


def test_a_cycle_is_found(tmp_path):
    copy = tmp_path / "parashift"
    shutil.copytree(os.path.dirname(parashift.__file__), copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "layers" / "ring_a.py").write_text("def f():\n    from parashift.layers import "
                                               "ring_b  # noqa: F401\n")
    (copy / "layers" / "ring_b.py").write_text("from parashift.layers import ring_a  # noqa\n")
    assert ["parashift.layers.ring_a", "parashift.layers.ring_b"] in _cycles(str(tmp_path))

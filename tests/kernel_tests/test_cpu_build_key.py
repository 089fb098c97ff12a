"""The CPU kernels' build cache key covers every source and header of kernels/cpu, found by
listing the folder: a header added or changed there gives another library name (a stale build
is never reused), and nothing else changes it."""

from __future__ import annotations

import importlib.util
import os
import shutil

import parashift.kernels.cpu.build as build

FOLDER = os.path.dirname(build.__file__)


def _build_module(folder: str):
    spec = importlib.util.spec_from_file_location("copied_build", os.path.join(folder, "build.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_source_and_header_of_the_folder_is_in_the_key(tmp_path):
    assert {os.path.basename(p) for p in build.SOURCES + build.HEADERS} == {
        name for name in os.listdir(FOLDER) if name.endswith((".cpp", ".h"))}
    folder = tmp_path / "cpu"
    shutil.copytree(FOLDER, folder, ignore=shutil.ignore_patterns("__pycache__"))
    before = _build_module(str(folder)).library_path("/b", "g++")
    assert _build_module(str(folder)).library_path("/b", "g++") == before
    (folder / "new_tile.h").write_text("// a header no list names\n")
    added = _build_module(str(folder)).library_path("/b", "g++")
    assert added != before
    (folder / "new_tile.h").write_text("// changed\n")
    assert _build_module(str(folder)).library_path("/b", "g++") not in (before, added)

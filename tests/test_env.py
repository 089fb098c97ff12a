"""The cache folder: created private, refused (naming it) when others could plant what it
holds, which is loaded as code (the CPU kernels) and weights."""

from __future__ import annotations

import os

import pytest

from parashift import env


def test_the_cache_folder_is_created_private(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("PARASHIFT_CACHE_DIR", str(folder))
    assert env.cache_dir() == str(folder)
    assert os.stat(folder).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_a_cache_folder_others_can_write_is_refused(tmp_path, monkeypatch, mode):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    monkeypatch.setenv("PARASHIFT_CACHE_DIR", str(folder))
    with pytest.raises(RuntimeError, match=f"{folder} \\(mode {mode:o}"):
        env.cache_dir()

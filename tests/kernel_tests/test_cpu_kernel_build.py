"""The CPU kernels' build: cached per CPU and rebuilt when corrupt, a planted library never
loaded, no compiler meaning no kernels (the torch path), and --cpu-kernels off turning them
off."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from parashift.kernels.cpu import build as kernel_build
from parashift.kernels.cpu import library


def test_the_build_is_cached_per_cpu_and_rebuilt_when_corrupt(tmp_path, monkeypatch):
    # unoptimized: three builds in seconds (the caching is under test here, not the code)
    monkeypatch.setattr(kernel_build, "_FLAGS",
                        ["-O0" if f == "-O3" else f for f in kernel_build._FLAGS])
    build_dir = str(tmp_path)
    first = kernel_build.build(build_dir)
    built_at = os.stat(first).st_mtime_ns
    assert kernel_build.build(build_dir) == first and os.stat(first).st_mtime_ns == built_at
    monkeypatch.setattr(kernel_build, "_cpu_identity", lambda: "another CPU")
    other = kernel_build.build(build_dir)
    assert other != first and os.path.exists(first)
    with open(other, "wb") as f:
        f.write(b"not a library")
    ops = library.load(build_dir)  # its sha256 no longer matches: built again before loading
    assert ops.path == other and os.path.getsize(other) > 1000


def test_a_planted_library_is_never_loaded(tmp_path, monkeypatch):
    """A file put under the library's predictable name (a shared or writable cache folder) is
    rebuilt over, not dlopen'ed: only a library this build wrote, with its sha256 beside it,
    loads."""
    monkeypatch.setattr(kernel_build, "_FLAGS",
                        ["-O0" if f == "-O3" else f for f in kernel_build._FLAGS])
    compiler = kernel_build.shutil.which("g++") or kernel_build.shutil.which("c++")
    path = kernel_build.library_path(str(tmp_path), compiler)
    planted = tmp_path / "planted.c"
    planted.write_text("__attribute__((constructor)) static void run(void) {"
                       " __builtin_trap(); }\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-x", "c", str(planted), "-o", path],
                   check=True)
    with open(f"{path}.sha256", "w") as f:
        f.write("0" * 64)  # a digest that is not the file's
    ops = library.load(str(tmp_path))  # the planted file would abort this process on load
    assert ops.path == path and kernel_build.is_intact(path)


def test_no_compiler_means_no_kernels_and_the_torch_path(tmp_path, monkeypatch, caplog):
    from parashift.layers import kernel_dispatch

    monkeypatch.setattr(kernel_build.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        kernel_build.build(str(tmp_path))
    monkeypatch.setenv("PARASHIFT_CACHE_DIR", str(tmp_path))
    kernel_dispatch.cpu_ops.cache_clear()
    try:
        assert kernel_dispatch.cpu_ops() is None
        assert "CPU kernels unavailable" in caplog.text
        assert not kernel_dispatch.on_cpu_kernels(torch.zeros(1))
    finally:
        kernel_dispatch.cpu_ops.cache_clear()


def test_cpu_kernels_off_turns_them_off(tiny_llama):
    from parashift import LLM, SamplingParams
    from parashift.config import DeviceConfig
    from parashift.layers import kernel_dispatch
    from parashift.layers.attention.cpu_backend import CpuAttentionBackend

    try:
        llm = LLM(tiny_llama, cpu_kernels="off", max_model_len=64)
        try:
            assert kernel_dispatch.cpu_ops() is None
            assert CpuAttentionBackend().ops is None  # then it is the torch backend
            out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 2
        finally:
            llm.shutdown()
    finally:
        kernel_dispatch.use_cpu_kernels("native")
    assert kernel_dispatch.cpu_ops() is not None
    for bad in ("native; rm -rf /", "-O0", ""):
        with pytest.raises(ValueError, match="--cpu-kernels"):
            DeviceConfig("cpu", cpu_kernels=bad)

"""The GEMM path choice (layers/gemm_paths.py): every candidate computes the same product and
keeps one copy of the weight, the choice is cached per CPU, a cached choice is used without
timing, and a corrupt cache is timed again and rewritten. (Which path is fastest is the
machine's answer: no timing asserted.)"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from parashift.layers import gemm_paths
from parashift.layers.gemm import Gemm, gemm_for_path
from parashift.layers.gemm_paths import (
    GemmPaths,
    cache_file,
    candidates,
    prepare_gemm_weights,
    prepares_shared_weights,
    weight_bytes,
)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 5, 32])
def test_every_path_gives_the_same_product(dtype, atol, rows):
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 64, generator=g) * 0.1).to(dtype)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    reference = x.double() @ weight.double().t()
    for path in candidates(dtype):
        out = gemm_for_path(weight, path)(x, None)
        assert out.dtype == dtype and out.shape == (rows, 96), path
        assert torch.allclose(out.double(), reference, atol=atol, rtol=atol), path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_takes_a_bias_and_leading_dims(dtype):
    g = torch.Generator().manual_seed(1)
    weight, bias = (torch.randn(40, 24, generator=g).to(dtype), torch.randn(40, generator=g))
    x = torch.randn(2, 3, 24, generator=g).to(dtype)
    reference = x.double() @ weight.double().t() + bias.to(dtype).double()
    for path in candidates(dtype):
        gemm = gemm_for_path(weight, path)
        out = gemm(x, bias.to(gemm.weight.dtype))
        assert out.shape == (2, 3, 40), path
        assert torch.allclose(out.double(), reference, atol=5e-2, rtol=2e-2), path


def test_the_cache_file_is_per_cpu():
    a = cache_file("AMD EPYC 7B13|avx2|torch 2.13.0|2 threads")
    b = cache_file("Intel(R) Xeon(R) Platinum 8481C|avx2+avx512f|torch 2.13.0|2 threads")
    c = cache_file("AMD EPYC 7B13|avx2|torch 2.13.0|1 threads")
    assert len({a, b, c}) == 3
    assert "amd-epyc-7b13" in a and "intel-r-xeon" in b


def test_a_cached_choice_is_used_and_new_ones_are_saved(tmp_path, monkeypatch):
    path = tmp_path / "cpu.json"
    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a, **k: {"linear": 2.0, "onednn": 1.0})
    paths = GemmPaths(str(path))
    assert paths.choose(torch.float32, 96, 64) == "onednn"
    paths.save()
    saved = json.loads(path.read_text())
    assert set(saved["choices"]) == {"float32:96x64"} and "cpu" in saved

    def no_timing(*args):
        raise AssertionError("a cached shape was timed again")

    monkeypatch.setattr(gemm_paths, "time_paths", no_timing)
    again = GemmPaths(str(path))
    assert again.choose(torch.float32, 96, 64) == paths.choices["float32:96x64"]
    again.save()  # nothing new: the file is left as it was
    assert json.loads(path.read_text()) == saved


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"choices": {"float32:1x1": 3}}',
                                     '{"choices": [1]}'])
def test_a_corrupt_cache_is_timed_again_and_rewritten(tmp_path, monkeypatch, content):
    path = tmp_path / "cpu.json"
    path.write_text(content)
    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a, **k: {"linear": 1.0})
    paths = GemmPaths(str(path))
    assert paths.choices == {}
    assert paths.choose(torch.float32, 8, 8) == "linear"
    paths.save()
    assert json.loads(path.read_text())["choices"] == {"float32:8x8": "linear"}


def test_a_stale_choice_for_a_missing_path_is_timed_again(tmp_path, monkeypatch):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"choices": {"bfloat16:8x8": "fp32-packed"}}))  # a path no more
    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a, **k: {"linear": 1.0})
    assert GemmPaths(str(path)).choose(torch.bfloat16, 8, 8) == "linear"


def test_onednn_row_buckets_are_few_and_cover_every_count():
    from parashift.layers.gemm import onednn_rows

    buckets = {onednn_rows(m) for m in range(1, 8193)}
    # one cached kernel per bucket and shape, not per token count (oneDNN keeps 1,024)
    assert len(buckets) <= 160
    assert all(m <= onednn_rows(m) <= m * 17 / 16 for m in range(1, 8193))  # little padding
    assert [onednn_rows(m) for m in (1, 17, 32, 33, 256, 257, 300, 1035, 2048)] == [
        1, 17, 32, 34, 256, 272, 304, 1088, 2048]


@pytest.mark.skipif(not gemm_paths.can_reorder(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("rows", [17, 300])
def test_a_padded_onednn_gemm_returns_just_its_rows(rows):
    g = torch.Generator().manual_seed(2)
    weight, x = torch.randn(24, 16, generator=g), torch.randn(rows, 16, generator=g)
    out = gemm_for_path(weight, "onednn")(x, None)
    assert out.shape == (rows, 24)
    assert torch.allclose(out, x @ weight.t(), atol=1e-4)


def test_each_path_is_its_own_class():
    weight = torch.randn(16, 8)
    assert type(gemm_for_path(weight, "linear")) is Gemm
    if gemm_paths.can_reorder():
        assert gemm_for_path(weight, "onednn").kind == "onednn"
    if gemm_paths.can_own_bf16():
        assert gemm_for_path(weight.bfloat16(), "own-bf16").kind == "own-bf16"


def _choosing(times_by_rows):
    def times(dtype, out_features, in_features, rows=gemm_paths.ROWS, paths=None, **_):
        return {path: t for path, t in times_by_rows[rows].items() if path in paths}
    return times


@pytest.mark.parametrize("prefill,chosen", [({"own-bf16": 1.0, "onednn": 0.95}, "own-bf16"),
                                            ({"own-bf16": 1.0, "onednn": 0.8}, "onednn")])
def test_our_kernel_must_hold_at_prefill_rows_too(tmp_path, monkeypatch, prefill, chosen):
    """Our bf16 kernel runs every row count: it wins at decode rows, and is kept unless
    another path is more than 10% faster at prefill rows."""
    monkeypatch.setattr(gemm_paths, "candidates", lambda dtype: ["linear", "onednn", "own-bf16"])
    monkeypatch.setattr(gemm_paths, "time_paths", _choosing({
        gemm_paths.ROWS: {"linear": 3.0, "onednn": 2.0, "own-bf16": 1.0},
        gemm_paths.PREFILL_ROWS: {"linear": 5.0, **prefill}}))
    paths = GemmPaths(str(tmp_path / "cpu.json"))
    assert paths.choose(torch.bfloat16, 64, 32) == chosen
    paths.save()
    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a, **k: pytest.fail("timed again"))
    assert GemmPaths(str(tmp_path / "cpu.json")).choose(torch.bfloat16, 64, 32) == chosen


class _Head(nn.Module):
    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight
        self.gemm = Gemm(weight)


class _Tied(nn.Module):
    """An embedding's weight read by a head too, and a projection of its own."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.embed = nn.Parameter(torch.randn(96, 64, generator=g).to(dtype), requires_grad=False)
        self.head = _Head(self.embed)
        self.proj = _Head(nn.Parameter(torch.randn(64, 64, generator=g).to(dtype),
                                       requires_grad=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_keeps_one_copy_and_a_shared_weight_one_more(tmp_path, monkeypatch, dtype):
    """Whichever path each weight takes, the model keeps the same bytes: a prepared path's copy
    replaces the plain weight (a meta tensor then), and the same product comes out; a weight
    another module reads keeps its plain copy, and its GEMM a prepared one beside it."""
    monkeypatch.setenv("PARASHIFT_CACHE_DIR", str(tmp_path))
    x = torch.randn(3, 64).to(dtype)
    plain = _Tied(dtype)
    reference = (plain.head.gemm(x, None), plain.proj.gemm(x, None))
    base = weight_bytes(plain)
    for path in candidates(dtype):
        model = _Tied(dtype)
        monkeypatch.setattr(GemmPaths, "choose", lambda self, dtype, *shape, shared=False,
                            policy=None, path=path: (path if not shared or path != "linear"
                                                     else "onednn"))
        prepare_gemm_weights(model, torch.device("cpu"))
        assert model.proj.weight.is_meta == (path != "linear"), path
        assert not model.embed.is_meta and model.head.weight is model.embed
        extra = 96 * 64 * model.embed.element_size() if prepares_shared_weights(dtype) else 0
        assert weight_bytes(model) == base + extra, path
        for got, want in zip((model.head.gemm(x, None), model.proj.gemm(x, None)), reference,
                             strict=True):
            assert torch.allclose(got.double(), want.double(), atol=2e-2, rtol=2e-2), path


def test_a_shared_weight_is_timed_without_f_linear(tmp_path, monkeypatch):
    timed = []
    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a, paths=None, **k: (
        timed.append(paths), {p: 1.0 for p in paths})[1])
    paths = GemmPaths(str(tmp_path / "cpu.json"))
    choice = paths.choose(torch.float32, 96, 64, shared=True)
    if prepares_shared_weights(torch.float32):  # the one prepared fp32 path: nothing to time
        assert choice == "onednn" and timed == []
    assert paths.choose(torch.float32, 96, 64) in timed[-1]  # its own key, timed
    if gemm_paths.can_own_bf16() and prepares_shared_weights(torch.bfloat16):
        assert paths.choose(torch.bfloat16, 96, 64, shared=True) != "linear"
        assert "linear" not in timed[-1]


def test_the_configs_policy_limits_the_choice(tmp_path, monkeypatch):
    """--gemm-paths linear: every weight on F.linear, its plain weight kept, nothing timed;
    an unknown path, or one without linear, is refused naming the flag."""
    from parashift.config import DeviceConfig

    monkeypatch.setenv("PARASHIFT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a, paths=None, **k: (
        {p: 1.0 for p in paths} if len(paths) > 1 else pytest.fail("timed one path")))
    model = _Tied(torch.bfloat16)
    notes = prepare_gemm_weights(model, torch.device("cpu"), policy=("linear",))
    assert not any(p.is_meta for p in model.parameters()) and "2 linear" in notes[-1]
    for bad in (("linear", "mkl"), ("onednn",)):
        with pytest.raises(ValueError, match="--gemm-paths"):
            DeviceConfig("cpu", gemm_paths=bad)

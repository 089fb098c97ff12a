"""The GEMM path choice (layers/gemm_paths.py): every candidate computes the same product, the
choice is cached per CPU, a cached choice is used without timing, and a corrupt cache is timed
again and rewritten. (Which path is fastest is the machine's answer: no timing asserted.)"""

from __future__ import annotations

import json

import pytest
import torch

from parashift.layers import gemm_paths
from parashift.layers.gemm import Gemm, OwnBf16Gemm, gemm_for_path
from parashift.layers.gemm_paths import GemmPaths, cache_file, candidates


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
    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a: {"linear": 2.0, "packed": 1.0}
                        if a[0] == torch.float32 else {"linear": 1.0})
    paths = GemmPaths(str(path))
    assert paths.choose(torch.float32, 96, 64) == ("packed" if gemm_paths.can_pack()
                                                   else "linear")
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
                                     '{"choices": {}, "row_limits": {"bfloat16:8x8": "x"}}'])
def test_a_corrupt_cache_is_timed_again_and_rewritten(tmp_path, monkeypatch, content):
    path = tmp_path / "cpu.json"
    path.write_text(content)
    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a: {"linear": 1.0})
    paths = GemmPaths(str(path))
    assert paths.choices == {}
    assert paths.choose(torch.float32, 8, 8) == "linear"
    paths.save()
    assert json.loads(path.read_text())["choices"] == {"float32:8x8": "linear"}


def test_a_stale_choice_for_a_missing_path_is_timed_again(tmp_path, monkeypatch):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"choices": {"bfloat16:8x8": "packed"}}))  # not a bf16 path
    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a: {"fp32": 1.0})
    assert GemmPaths(str(path)).choose(torch.bfloat16, 8, 8) == "fp32"


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


@pytest.mark.skipif(not gemm_paths.can_own_bf16(), reason="no bf16 GEMM of ours on this CPU")
def test_our_bf16_kernel_hands_rows_past_its_limit_to_f_linear():
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 32, generator=g).bfloat16()
    own, unlimited = OwnBf16Gemm(weight, max_rows=4), OwnBf16Gemm(weight)
    x = torch.randn(5, 32, generator=g).bfloat16()
    assert torch.equal(own(x[:4], None), unlimited(x[:4], None))
    assert torch.equal(own(x, None), F.linear(x, weight))


def test_each_path_is_its_own_class():
    weight = torch.randn(16, 8)
    assert type(gemm_for_path(weight, "linear")) is Gemm
    widened = gemm_for_path(weight.bfloat16(), "fp32")
    assert type(widened) is Gemm and widened.weight.dtype == torch.float32
    if gemm_paths.can_pack():
        assert gemm_for_path(weight.bfloat16(), "fp32-packed").kind == "packed"
    if gemm_paths.can_reorder():
        assert gemm_for_path(weight, "onednn").kind == "onednn"


def test_the_row_limit_is_the_last_probe_our_kernel_wins_and_is_cached(tmp_path, monkeypatch):
    path = tmp_path / "cpu.json"
    probed = []

    def times(dtype, out_features, in_features, rows, paths):
        probed.append(rows)
        assert paths == ("own-bf16", "linear")
        return {"own-bf16": 1.0, "linear": 2.0 if rows <= 256 else 0.5}

    monkeypatch.setattr(gemm_paths, "time_paths", times)
    paths = GemmPaths(str(path))
    assert paths.row_limit(torch.bfloat16, 64, 32) == 256
    assert probed == [64, 128, 256, 512]  # stops at the first loss
    paths.save()

    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a, **k: pytest.fail("timed again"))
    assert GemmPaths(str(path)).row_limit(torch.bfloat16, 64, 32) == 256


def test_a_near_tie_keeps_our_kernel_at_batch_rows_only(tmp_path, monkeypatch):
    # F.linear 5% faster everywhere: within the margin at 64 and 128 rows, not from 256
    monkeypatch.setattr(gemm_paths, "time_paths", lambda *a, **k: {"own-bf16": 1.0,
                                                                  "linear": 0.95})
    assert GemmPaths(str(tmp_path / "cpu.json")).row_limit(torch.bfloat16, 64, 32) == 128

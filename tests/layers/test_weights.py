"""The safetensors reader: every slice a tensor-parallel rank can ask for equals torch's
narrow of the whole tensor, for every dtype layout, with chunked column reads."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from parashift.layers import weights
from parashift.layers.weights import iterate_weights


def test_narrow_and_load_equal_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "CHUNK_BYTES", 64)  # column slices read in several chunks
    tensors = {"w3d": torch.randn(7, 5, 3), "bf16": torch.randn(6, 4).bfloat16(),
               "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
               "vec": torch.randn(10).half(), "scalar": torch.tensor(3.5)}
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    seen = set()
    for source in iterate_weights(str(tmp_path)):
        want = tensors[source.name]
        seen.add(source.name)
        assert source.shape == tuple(want.shape)
        assert torch.equal(source.load(), want)
        for dim in range(want.dim()):
            for start in range(want.shape[dim]):
                for length in range(1, want.shape[dim] - start + 1):
                    got = source.narrow(dim, start, length)
                    assert got.dtype == want.dtype
                    assert torch.equal(got, want.narrow(dim, start, length))
    assert seen == set(tensors)


def test_not_a_safetensors_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!")
    with pytest.raises(ValueError, match="is not a valid safetensors file"):
        list(iterate_weights(str(tmp_path)))


def test_a_tensor_of_the_wrong_shape_is_named_before_a_slice_is_read(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.ones(2, 4)}, str(tmp_path / "m.safetensors"))
    source = next(s for s in iterate_weights(str(tmp_path)) if s.name == "a")
    assert source.expect(3, 4) is source
    with pytest.raises(ValueError, match=r"'a' has shape \[3, 4\], the model expects \[4, 4\]"):
        source.expect(4, 4)


def test_a_header_past_the_end_of_the_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="past the end of the file"):
        list(iterate_weights(str(tmp_path)))


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/../../x.safetensors"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path, name):
    import json

    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": name}}))
    with pytest.raises(ValueError, match="outside"):
        weights.safetensors_files(str(tmp_path))

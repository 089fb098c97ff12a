"""Checkpoint tensors handed to the layers' weight loaders, read lazily so that a rank
materialises only its own shard when the file format allows slicing (safetensors does)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


class WeightSource:
    """One checkpoint tensor: `narrow` reads just a slice, `load` reads all of it."""

    def __init__(self, name: str, tensor: torch.Tensor | None = None, file_slice=None):
        self.name = name
        self._tensor = tensor
        self._slice = file_slice

    @property
    def shape(self) -> tuple[int, ...]:
        if self._tensor is not None:
            return tuple(self._tensor.shape)
        return tuple(self._slice.get_shape())

    def load(self) -> torch.Tensor:
        return self._tensor if self._tensor is not None else self._slice[:]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if start == 0 and length == self.shape[dim]:
            return self.load()
        if self._tensor is not None:
            return self._tensor.narrow(dim, start, length)
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's .safetensors files, in the order of its index when it is sharded."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, name) for name in names]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {folder}")
    return [os.path.join(folder, name) for name in files]


def iterate_weights(folder: str) -> Iterator[WeightSource]:
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield WeightSource(name, file_slice=f.get_slice(name))

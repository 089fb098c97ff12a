"""Checkpoint tensors handed to the layers' weight loaders, read lazily so that a rank
materialises only its own shard when the file format allows slicing (safetensors does).

Safetensors files are read with positioned reads (preadv), not mmap: a tensor-parallel
rank reads only the bytes of its slice (a column slice row by row, in bounded chunks), and
the page cache never counts towards a worker's resident memory."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
CHUNK_BYTES = 16 << 20  # the most a strided (column) slice reads at once


class SafetensorsFile:
    """The header of one .safetensors file and positioned reads of its tensors."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            (size,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            if size > os.fstat(self.fd).st_size - 8:
                raise ValueError(f"a header of {size} bytes is past the end of the file")
            header = json.loads(os.pread(self.fd, size, 8))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (struct.error, ValueError, OverflowError) as e:  # JSON errors are ValueErrors
            os.close(self.fd)
            raise ValueError(f"{path} is not a valid safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self.data_start = 8 + size
        self.entries = header

    def close(self) -> None:
        os.close(self.fd)

    def read(self, offset: int, nbytes: int) -> torch.Tensor:
        """`nbytes` bytes at `offset` from the start of the data, as a uint8 tensor."""
        out = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(out.numpy()), 0
        while done < nbytes:  # one call reads at most ~2 GiB on Linux
            got = os.preadv(self.fd, [view[done:]], self.data_start + offset + done)
            if got <= 0:
                raise ValueError(f"{self.path}: truncated at byte {self.data_start + offset}")
            done += got
        return out


class WeightSource:
    """One checkpoint tensor: `narrow` reads just a slice, `load` reads all of it."""

    def __init__(self, name: str, tensor: torch.Tensor | None = None,
                 file: SafetensorsFile | None = None):
        self.name = name
        self._tensor = tensor
        self._file = file
        if file is not None:
            entry = file.entries[name]
            if entry["dtype"] not in _DTYPES:
                raise ValueError(f"{name}: unsupported safetensors dtype {entry['dtype']}")
            self._dtype = _DTYPES[entry["dtype"]]
            self._shape = tuple(entry["shape"])
            self._offset = entry["data_offsets"][0]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._tensor.shape) if self._tensor is not None else self._shape

    def expect(self, *shape: int) -> WeightSource:
        """Checks the whole tensor's shape against the model's, before any slice is read: a
        slice past the end of a short tensor would read its neighbour's bytes."""
        if self.shape != shape:
            raise ValueError(f"checkpoint tensor {self.name!r} has shape {list(self.shape)}, "
                             f"the model expects {list(shape)}")
        return self

    def load(self) -> torch.Tensor:
        if self._tensor is not None:
            return self._tensor
        return self._read_rows(0, self._shape[0] if self._shape else 1, self._shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if start == 0 and length == self.shape[dim]:
            return self.load()
        if self._tensor is not None:
            return self._tensor.narrow(dim, start, length)
        shape = list(self._shape)
        if dim == 0:  # contiguous rows: one read
            shape[0] = length
            return self._read_rows(start, length, tuple(shape))
        # A column slice: read whole leading rows a chunk at a time, keep the slice.
        shape[dim] = length
        out = torch.empty(shape, dtype=self._dtype)
        row_bytes = math.prod(self._shape[1:]) * self._dtype.itemsize
        step = max(1, CHUNK_BYTES // max(1, row_bytes))
        for first in range(0, self._shape[0], step):
            rows = min(step, self._shape[0] - first)
            chunk = self._read_rows(first, rows, (rows, *self._shape[1:]))
            out[first:first + rows] = chunk.narrow(dim, start, length)
        return out

    def _read_rows(self, first: int, rows: int, shape: tuple[int, ...]) -> torch.Tensor:
        row_bytes = math.prod(self._shape[1:]) * self._dtype.itemsize
        raw = self._file.read(self._offset + first * row_bytes, rows * row_bytes)
        return raw.view(self._dtype).reshape(shape)


def safetensors_files(folder: str) -> list[str]:
    """The checkpoint's .safetensors files, in the order of its index when it is sharded."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        for name in names:  # a file the index names must lie in the model's folder
            if (not isinstance(name, str) or os.path.isabs(name)
                    or ".." in name.replace("\\", "/").split("/")):
                raise ValueError(f"{index}: the weight file {name!r} lies outside {folder}")
        return [os.path.join(folder, name) for name in names]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {folder}")
    return [os.path.join(folder, name) for name in files]


def iterate_weights(folder: str) -> Iterator[WeightSource]:
    for path in safetensors_files(folder):
        file = SafetensorsFile(path)
        try:
            for name in file.entries:
                yield WeightSource(name, file=file)
        finally:
            file.close()

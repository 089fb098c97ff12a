"""A step's host arrays on the model's device (layers/host_to_device.py): on CPU the array
itself, no copy; on CUDA the same values, copied from pinned memory without a wait."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parashift.layers.host_to_device import to_device


def test_on_cpu_the_array_is_the_tensor():
    array = np.arange(32, dtype=np.int64)
    tensor = to_device(array, torch.device("cpu"))
    assert tensor.data_ptr() == array.ctypes.data
    assert tensor.tolist() == list(range(32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")
def test_on_cuda_the_copy_does_not_wait_for_the_stream():
    device = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(20):  # the stream has work queued when the copy is issued
        busy = busy @ busy / 64
    arrays = [np.full(1000, i, dtype=np.int32) for i in range(8)]
    copies = [to_device(a, device) for a in arrays]  # the host buffers may go at once
    del arrays
    torch.cuda.synchronize()
    assert [c.unique().tolist() for c in copies] == [[i] for i in range(8)]

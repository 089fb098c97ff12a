"""Kernel tests run on the GPU when there is one, and otherwise in Triton's interpreter on CPU
tensors. The interpreter must be chosen before any `@triton.jit` decorator runs, so before a
kernel module is imported: these tests import them inside the test functions' modules only,
after this file has set the variable."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

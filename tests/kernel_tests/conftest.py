"""Kernel tests run on the GPU when there is one, and otherwise in Triton's interpreter on CPU
tensors. The interpreter must be chosen before any `@triton.jit` decorator runs, so before a
kernel module is imported: these tests import them inside the test functions' modules only,
after this file has set the variable.

`ops` is the CPU kernels built for each -march this CPU can run (builds.py), for the files that
test them with no such fixture of their own: test_cpu_kernels.py, test_cpu_attention_backend.py."""

import os

import pytest
import torch

from kernel_tests.builds import MARCHES, load_for

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module", params=list(MARCHES))
def ops(request, tmp_path_factory):
    """This CPU's build, and those for older x86 CPUs it can run: each kernel's every path."""
    return load_for(request.param, tmp_path_factory)

"""Triton kernels of the GPU path, each with its torch reference beside it (run on CPU under
Triton's interpreter in the tests). Leaves: they import nothing else of parashift."""

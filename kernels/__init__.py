"""Triton kernels and their torch references (filled in by the kernels issue)."""

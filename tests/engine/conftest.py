"""The offline engine that the test_engine*.py files share (one for all of them)."""

from __future__ import annotations

import pytest

from parashift import LLM

from .test_engine import MAX_MODEL_LEN


@pytest.fixture(scope="package")  # one engine for the package: the test_engine*.py modules share it
def llm(tiny_llama) -> LLM:
    """Roomy cache, large token budget, prefix caching on: the reference configuration."""
    return LLM(tiny_llama, dtype="float32", max_model_len=MAX_MODEL_LEN,
               kv_cache_memory=4 << 20)

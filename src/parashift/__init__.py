"""parashift: LLM inference with pluggable parallel layouts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parashift.engine.llm import LLM
    from parashift.engine.request_output import CompletionOutput, RequestOutput
    from parashift.types.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

_WHERE = {"LLM": "parashift.engine.llm", "SamplingParams": "parashift.types.sampling_params",
          "RequestOutput": "parashift.engine.request_output",
          "CompletionOutput": "parashift.engine.request_output"}


def __getattr__(name: str) -> Any:
    """Imported on first use, so that light commands (`parashift plan`) never load torch."""
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'parashift' has no attribute {name!r}")

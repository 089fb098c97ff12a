"""parashift: LLM inference with pluggable parallel layouts."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parashift.engine.llm import LLM
    from parashift.engine.request_output import CompletionOutput, RequestOutput
    from parashift.types.sampling_params import SamplingParams
    from parashift.types.structured_outputs import StructuredOutputsParams

# In a checkout (an editable install), the repository root holds kernels/, installed as
# parashift.kernels: on sys.path (`python -m` run from there puts it first) it would shadow
# the Hub's `kernels` package that transformers imports. The root is never an import root of
# ours, so it goes, before anything imports transformers.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.isfile(os.path.join(_CHECKOUT, "kernels", "cpu", "build.py")):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _CHECKOUT]

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput"]

_WHERE = {"LLM": "parashift.engine.llm", "SamplingParams": "parashift.types.sampling_params",
          "StructuredOutputsParams": "parashift.types.structured_outputs",
          "RequestOutput": "parashift.engine.request_output",
          "CompletionOutput": "parashift.engine.request_output"}


def __getattr__(name: str) -> Any:
    """Imported on first use, so that light commands (`parashift plan`) never load torch."""
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'parashift' has no attribute {name!r}")

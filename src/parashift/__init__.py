"""parashift: LLM inference with pluggable parallel layouts."""

from parashift.engine.llm import LLM
from parashift.engine.request_output import CompletionOutput, RequestOutput
from parashift.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

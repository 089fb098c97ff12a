"""What the offline LLM and the API server both keep per request: the n samples a prompt fans
out into (their ids), each sample's tokens, logprobs, detokenized text and finish, and the EOS
token engine requests stop at. `OutputProcessor` (offline) and `Generation` (HTTP) are thin
shells around this one tracker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from parashift.engine.detokenizer import IncrementalDetokenizer
from parashift.types.outputs import EngineCoreOutput, TokenLogprobs
from parashift.types.sampling_params import SamplingParams


def choose_eos_token_id(hf_config: Any, tokenizer: Any = None) -> int | None:
    """The model's EOS (the first of a list), else the tokenizer's."""
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return eos


@dataclass
class Sample:
    """One of a prompt's n samples (an engine request of its own)."""

    index: int  # among all samples of the tracked request
    prompt_index: int
    detokenizer: IncrementalDetokenizer
    wants_logprobs: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per token, when asked for
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SampleDelta:
    sample: Sample
    text: str  # newly final text
    num_new_logprobs: int
    finished: bool
    abort: bool  # a stop string ended it first: the engine must abort the sample


class RequestTracker:
    """The samples of one request (one or more prompts, n samples each)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.samples: dict[str, Sample] = {}
        self.num_unfinished = 0

    def add_prompt(self, prompt_id: str, prompt_index: int, prompt_token_ids: list[int],
                   params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """The engine requests for one prompt: (sample id, its sampling params) per sample."""
        ids = [prompt_id] if params.n == 1 else [f"{prompt_id}-{i}" for i in range(params.n)]
        requests = []
        for i, sample_id in enumerate(ids):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                           params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
            self.samples[sample_id] = Sample(len(self.samples), prompt_index, detok,
                                             params.logprobs is not None)
            requests.append((sample_id, params.for_sample(i)))
        self.num_unfinished += len(ids)
        return requests

    def apply(self, out: EngineCoreOutput) -> SampleDelta | None:
        """One engine delta for one sample; None once that sample has finished (a late delta
        after a stop string, whose abort is on its way)."""
        sample = self.samples.get(out.request_id)
        if sample is None or sample.finished:
            return None
        sample.token_ids.extend(out.new_token_ids)
        new_logprobs = 0
        if out.new_logprobs is not None and sample.wants_logprobs:
            sample.logprobs.append(out.new_logprobs)
            sample.cumulative_logprob += out.new_logprobs.logprobs[0]
            new_logprobs = 1
        delta = sample.detokenizer.apply(out)
        finished = delta.finish_reason is not None
        if finished:
            sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
            self.num_unfinished -= 1
        return SampleDelta(sample, delta.text, new_logprobs, finished, delta.abort)

    def unfinished_ids(self) -> list[str]:
        return [sid for sid, s in self.samples.items() if not s.finished]

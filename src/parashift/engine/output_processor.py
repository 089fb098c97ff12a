"""Turns the engine core's token deltas into RequestOutputs for `LLM.generate`: one
RequestTracker per prompt (samples, detokenized text, stop strings, logprobs), plus timings."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from parashift.engine.request_output import CompletionOutput, RequestMetrics, RequestOutput
from parashift.engine.request_tracker import RequestTracker, Sample
from parashift.types.outputs import EngineCoreOutput
from parashift.types.sampling_params import SamplingParams


@dataclass
class ProcessedOutputs:
    finished: list[RequestOutput]  # requests whose every sample finished this step
    to_abort: list[str]  # sample ids ended by a stop string: the engine must abort them
    text_deltas: list[tuple[str, str]]  # (sample id, newly final text)


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.requests: dict[str, tuple[RequestOutput, RequestTracker]] = {}
        self.parent_of: dict[str, str] = {}  # sample id -> request id

    def add_request(self, output: RequestOutput, params: SamplingParams
                    ) -> list[tuple[str, SamplingParams]]:
        """The engine requests (sample id, params) to add for this prompt."""
        tracker = RequestTracker(self.tokenizer)
        samples = tracker.add_prompt(output.request_id, 0, output.prompt_token_ids, params)
        self.requests[output.request_id] = (output, tracker)
        for sample_id, _ in samples:
            self.parent_of[sample_id] = output.request_id
        return samples

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        result = ProcessedOutputs([], [], [])
        for out in outputs:
            parent_id = self.parent_of.get(out.request_id)
            if parent_id is None:
                continue
            request, tracker = self.requests[parent_id]
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
                request.metrics.num_cached_tokens = out.num_cached_tokens
            delta = tracker.apply(out)
            if delta is None:
                continue
            if delta.abort:
                result.to_abort.append(out.request_id)
            if delta.text:
                result.text_deltas.append((out.request_id, delta.text))
            if not delta.finished:
                continue
            del self.parent_of[out.request_id]
            if tracker.num_unfinished == 0:
                del self.requests[parent_id]
                request.metrics.finished_time = now
                request.outputs = [_completion(s) for s in tracker.samples.values()]
                result.finished.append(request)
        return result


def _completion(sample: Sample) -> CompletionOutput:
    if not sample.wants_logprobs:
        return CompletionOutput(sample.index, sample.text, sample.token_ids,
                                sample.finish_reason, sample.stop_reason)
    logprobs = [dict(zip(lp.token_ids, lp.logprobs, strict=True)) for lp in sample.logprobs]
    return CompletionOutput(sample.index, sample.text, sample.token_ids, sample.finish_reason,
                            sample.stop_reason, logprobs, sample.cumulative_logprob)


def new_request_output(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       arrival_time: float) -> RequestOutput:
    return RequestOutput(request_id, prompt, prompt_token_ids,
                         metrics=RequestMetrics(arrival_time))

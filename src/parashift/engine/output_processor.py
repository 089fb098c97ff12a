"""Turns the engine core's token deltas into RequestOutputs: detokenizes, applies stop strings,
collects logprobs and timings, and folds the n samples of a request together."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from parashift.engine.detokenizer import IncrementalDetokenizer
from parashift.engine.request_output import CompletionOutput, RequestMetrics, RequestOutput
from parashift.types.outputs import EngineCoreOutput
from parashift.types.sampling_params import SamplingParams


@dataclass
class ProcessedOutputs:
    finished: list[RequestOutput]  # requests whose every sample finished this step
    to_abort: list[str]  # sample ids ended by a stop string: the engine must abort them
    text_deltas: list[tuple[str, str]]  # (sample id, newly final text)


@dataclass
class _Sample:
    parent: RequestOutput
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.samples: dict[str, _Sample] = {}
        self.num_unfinished: dict[str, int] = {}

    def add_request(self, output: RequestOutput, sample_ids: list[str],
                    params: SamplingParams) -> None:
        self.num_unfinished[output.request_id] = len(sample_ids)
        for index, sample_id in enumerate(sample_ids):
            completion = CompletionOutput(index, "", [],
                                          logprobs=[] if params.logprobs is not None else None,
                                          cumulative_logprob=0.0 if params.logprobs is not None
                                          else None)
            output.outputs.append(completion)
            detok = IncrementalDetokenizer(self.tokenizer, output.prompt_token_ids,
                                           params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
            self.samples[sample_id] = _Sample(output, completion, detok)

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        result = ProcessedOutputs([], [], [])
        for out in outputs:
            sample = self.samples.get(out.request_id)
            if sample is None:
                continue
            completion, metrics = sample.completion, sample.parent.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.num_cached_tokens = out.num_cached_tokens
            completion.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None and completion.logprobs is not None:
                lp = out.new_logprobs
                completion.logprobs.append(dict(zip(lp.token_ids, lp.logprobs, strict=True)))
                completion.cumulative_logprob += lp.logprobs[0]
            delta = sample.detokenizer.apply(out)
            if delta.abort:
                result.to_abort.append(out.request_id)
            completion.text = sample.detokenizer.text
            if delta.text:
                result.text_deltas.append((out.request_id, delta.text))
            if delta.finish_reason is None:
                continue
            completion.finish_reason = delta.finish_reason
            completion.stop_reason = delta.stop_reason
            del self.samples[out.request_id]
            parent_id = sample.parent.request_id
            self.num_unfinished[parent_id] -= 1
            if self.num_unfinished[parent_id] == 0:
                del self.num_unfinished[parent_id]
                metrics.finished_time = now
                result.finished.append(sample.parent)
        return result


def new_request_output(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       arrival_time: float) -> RequestOutput:
    return RequestOutput(request_id, prompt, prompt_token_ids,
                         metrics=RequestMetrics(arrival_time))

"""A step's sampled ids under async scheduling: left on the model's device, where the next
step's inputs take its placeholders from them, and on their way to the host through pinned
memory, without a wait (vLLM's AsyncModelRunnerOutput does the same). Whoever needs the values
on the host (the engine's output, the penalty counts) waits for that copy alone, not for the
device's later work."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from parashift.types.outputs import ModelRunnerOutput, TokenLogprobs


class SampledTokens:
    def __init__(self, ids: torch.Tensor):
        self.ids = ids  # [num_rows] int64, on the model's device
        self._copied: torch.cuda.Event | None = None
        if ids.is_cuda:
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = ids
        self._values: list[int] | None = None
        self._lock = threading.Lock()  # the engine's thread and the runner's may both ask

    def tolist(self) -> list[int]:
        with self._lock:
            if self._values is None:
                if self._copied is not None:
                    self._copied.synchronize()
                self._values = self._host.tolist()
            return self._values


@dataclass
class AsyncModelRunnerOutput:
    """A step's output whose ids may still be on their way to the host."""

    req_ids: list[str]
    sampled: SampledTokens
    logprobs: list[TokenLogprobs | None]

    def get_output(self) -> ModelRunnerOutput:
        return runner_output(self.req_ids, self.sampled.tolist(), self.logprobs)


def runner_output(req_ids: list[str], token_ids: list[int],
                  logprobs: list[TokenLogprobs | None]) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        dict(zip(req_ids, token_ids, strict=True)),
        {r: lp for r, lp in zip(req_ids, logprobs, strict=True) if lp is not None}
        if any(lp is not None for lp in logprobs) else None)


def resolved(output: ModelRunnerOutput | AsyncModelRunnerOutput | None
             ) -> ModelRunnerOutput | None:
    return output.get_output() if isinstance(output, AsyncModelRunnerOutput) else output

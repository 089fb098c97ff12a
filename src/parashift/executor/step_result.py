"""What a model runner's step gives back: one type for its three cases.

- Sampled: the output rank's sampled tokens (none for a step where no row samples).
- DEFERRED: the step's logits wait for their structured-output mask (async scheduling), on
  every rank of the step; `sample_tokens(mask)` samples them.
- NOT_OUTPUT_RANK: a pipeline stage before the last, or a tensor-parallel rank other than 0:
  nothing to send (the output rank answers for the step)."""

from __future__ import annotations

from dataclasses import dataclass

from parashift.executor.sampled_tokens import AsyncModelRunnerOutput, resolved
from parashift.types.outputs import ModelRunnerOutput


@dataclass(frozen=True, slots=True)
class Sampled:
    output: ModelRunnerOutput | AsyncModelRunnerOutput

    def host_output(self) -> ModelRunnerOutput:
        """The output with its ids on the host (waits for their copy, under async)."""
        return resolved(self.output)


def nothing_sampled() -> Sampled:
    return Sampled(ModelRunnerOutput({}))


class _Deferred:
    def __repr__(self) -> str:
        return "DEFERRED"


class _NotOutputRank:
    def __repr__(self) -> str:
        return "NOT_OUTPUT_RANK"


DEFERRED = _Deferred()
NOT_OUTPUT_RANK = _NotOutputRank()

StepResult = Sampled | _Deferred | _NotOutputRank

"""How far a request may run ahead of its results: the one policy the scheduler asks.

The engine keeps `depth` batches in flight (engine/core.py). Three policies:
- OneStep: one batch at a time; nothing is ever in flight when the scheduler runs.
- Placeholders (async scheduling, two batches): a request whose step is in flight is
  scheduled again at once; the token that step will sample is a placeholder
  (`num_output_placeholders`) that the runner fills from its own sampled ids. Not when the
  tokens in flight already reach its length limits (the step would be thrown away).
- Pipeline (a pipeline's stages, one batch each): the first stage cannot know what the last
  samples, so a request is in at most one batch; each batch is made of the other requests,
  and each takes about an equal share of the ready tokens, so that every stage stays busy.

A request preempted or aborted while in flight keeps its place in no batch; the stale result
is dropped when it returns (Scheduler.update_from_output)."""

from __future__ import annotations

from collections.abc import Iterable

from parashift.engine.request import Request


class OneStep:
    depth = 1

    def may_schedule(self, req: Request) -> bool:
        """Whether a running request gets tokens in the batch being made."""
        return True

    def batch_token_target(self, budget: int, requests: Iterable[Request]) -> int:
        """How many tokens the batch being made should hold."""
        return budget

    def submitted(self, requests: Iterable[Request]) -> None:
        """The batch of these requests goes in flight."""

    def returned(self, requests: Iterable[Request]) -> None:
        """Their batch's result is in."""


class _InFlight(OneStep):
    """Counts each request's batches in flight (Request.num_in_flight)."""

    def __init__(self, depth: int, max_model_len: int):
        self.depth = depth
        self.max_model_len = max_model_len

    def submitted(self, requests: Iterable[Request]) -> None:
        for req in requests:
            req.num_in_flight += 1

    def returned(self, requests: Iterable[Request]) -> None:
        for req in requests:
            req.num_in_flight -= 1


class Placeholders(_InFlight):
    def may_schedule(self, req: Request) -> bool:
        if not req.num_in_flight:
            return True
        num_outputs = req.num_output_tokens + req.num_output_placeholders
        max_tokens = req.params.max_tokens
        return ((max_tokens is None or num_outputs < max_tokens)
                and req.num_tokens + req.num_output_placeholders < self.max_model_len)


class Pipeline(_InFlight):
    def may_schedule(self, req: Request) -> bool:
        return not req.num_in_flight

    def batch_token_target(self, budget: int, requests: Iterable[Request]) -> int:
        """The requests' next steps (a decode token, or what is left of the prompt; a request
        in flight counts its step after that one) spread evenly over the batches of a round
        through the pipeline, so that a big batch is not followed by a tiny one while a stage
        waits. Requests join whole until the target is reached (cutting a prompt to balance
        would only serialise it: its halves cannot be in flight together)."""
        depth, work = self.depth, 0
        for req in requests:
            if work >= depth * budget:
                break
            work += max(1, req.num_tokens - req.num_computed_tokens)
        return max(1, min(budget, -(-work // depth)))


def run_ahead_policy(depth: int, placeholders: bool, max_model_len: int) -> OneStep:
    if depth == 1:
        return OneStep()
    return (Placeholders if placeholders else Pipeline)(depth, max_model_len)

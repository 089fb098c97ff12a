"""The model runner's copy of every running request: its tokens, blocks and sampling settings,
updated from each scheduler step's deltas, so a step command carries only what changed (what a
remote worker needs). The scheduler tests' runner keeps its requests here too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parashift.layers.penalties import TokenCounts
from parashift.types.outputs import NewRequestData, SchedulerOutput
from parashift.types.sampling_params import SamplingParams


@dataclass
class RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    counts: TokenCounts | None = None  # for penalties: kept across steps, only where used

    @classmethod
    def of(cls, new: NewRequestData) -> RequestState:
        token_ids = list(new.token_ids)
        counts = None
        if new.params.has_penalties:
            prompt = new.num_prompt_tokens
            counts = TokenCounts(token_ids[:prompt], token_ids[prompt:])
        return cls(token_ids, new.num_prompt_tokens, new.params, list(new.block_ids),
                   new.num_computed_tokens, counts)


class RequestStates(dict[str, RequestState]):
    def apply(self, out: SchedulerOutput) -> None:
        """A step's deltas: requests freed, new ones, and the running ones' new tokens and
        blocks (a preempted request comes back as new)."""
        for req_id in out.freed_req_ids:
            self.pop(req_id, None)
        for new in out.new_reqs:
            self[new.req_id] = RequestState.of(new)
        for cached in out.cached_reqs:
            state = self[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            if state.counts is not None:
                state.counts.add(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    @staticmethod
    def advance(states: list[RequestState], q_lens: np.ndarray) -> list[int]:
        """After a step computed `q_lens` tokens of each of `states`: the rows that have all
        their tokens computed now, which sample (a partial prefill chunk only fills the
        cache)."""
        rows = []
        for i, (state, q_len) in enumerate(zip(states, q_lens, strict=True)):
            state.num_computed_tokens += int(q_len)
            if state.num_computed_tokens == len(state.token_ids):
                rows.append(i)
        return rows

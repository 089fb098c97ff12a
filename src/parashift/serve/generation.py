"""One HTTP request's generation: its prompts x n samples become engine requests; their token
deltas come back merged, detokenized and cut at stop strings. While streaming, text that could
still turn out to be the start of a stop string is held back, so a stop string never leaks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from parashift.engine.request_tracker import RequestTracker, SampleDelta
from parashift.serve.broker import Broker, RequestFailedError
from parashift.serve.openai_protocol import OpenAIError
from parashift.types.outputs import EngineCoreOutput
from parashift.types.sampling_params import SamplingParams


@dataclass
class Timing:
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None


class Generation:
    def __init__(self, broker: Broker, tokenizer: Any, request_id: str,
                 prompts: list[list[int]], params: list[SamplingParams],
                 eos_token_id: int | None, rank: int | None):
        self.broker = broker
        self.request_id = request_id
        self.prompts = prompts
        self.timing = Timing()
        self.tracker = RequestTracker(tokenizer)
        self.choices = self.tracker.samples  # sample id -> Sample (one per choice)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self.engine = engine = broker.pick_engine(rank)
        try:
            self._add_all(tokenizer, params, eos_token_id, engine)
        except BaseException:
            self.abort_unfinished()  # never leave half a request in flight
            raise

    def _add_all(self, tokenizer: Any, params: list[SamplingParams], eos_token_id: int | None,
                 engine: int) -> None:
        broker, request_id = self.broker, self.request_id
        for prompt_index, (prompt, sp) in enumerate(zip(self.prompts, params, strict=True)):
            # n == 1 still gets its own id: every choice of the request is told apart.
            prompt_id = f"{request_id}-{prompt_index}" + ("-0" if sp.n == 1 else "")
            for sample_id, sample_params in self.tracker.add_prompt(prompt_id, prompt_index,
                                                                    prompt, sp):
                queue = broker.add_request(sample_id, prompt, sample_params, eos_token_id,
                                           engine)
                self._pumps.append(asyncio.create_task(self._pump(sample_id, queue)))

    async def _pump(self, child_id: str, queue: asyncio.Queue) -> None:
        while True:
            item = await queue.get()
            await self._queue.put((child_id, item))
            if isinstance(item, Exception) or item.finished:
                return

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    async def stream(self) -> AsyncIterator[SampleDelta]:
        """Yields text deltas as they become final; returns when every choice finished."""
        unfinished = len(self.choices)
        try:
            while unfinished:
                child_id, item = await self._queue.get()
                if isinstance(item, RequestFailedError):
                    raise OpenAIError(400, str(item))
                if isinstance(item, Exception):
                    raise item
                delta = self._apply(item)
                if delta is None:
                    continue  # ended by a stop string; its abort is on the way
                if delta.finished:
                    unfinished -= 1
                if delta.text or delta.num_new_logprobs or delta.finished:
                    yield delta
            self.timing.finished = time.monotonic()
        finally:
            self.abort_unfinished()

    def _apply(self, out: EngineCoreOutput) -> SampleDelta | None:
        if out.new_token_ids and self.timing.first_token is None:
            self.timing.first_token = time.monotonic()
        delta = self.tracker.apply(out)
        if delta is not None and delta.abort:
            self.broker.abort([out.request_id])
        return delta

    def abort_unfinished(self) -> None:
        for task in self._pumps:
            task.cancel()
        pending = self.tracker.unfinished_ids()
        if pending:
            self.broker.abort(pending)

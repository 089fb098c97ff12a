"""One HTTP request's generation: its prompts x n samples become engine requests; their token
deltas come back merged, detokenized and cut at stop strings. While streaming, text that could
still turn out to be the start of a stop string is held back, so a stop string never leaks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from parashift.engine.detokenizer import IncrementalDetokenizer
from parashift.serve.broker import Broker
from parashift.serve.openai_protocol import OpenAIError
from parashift.types.outputs import EngineCoreOutput, TokenLogprobs
from parashift.types.sampling_params import SamplingParams


@dataclass
class Choice:
    index: int
    prompt_index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return self.detokenizer.text


@dataclass
class Delta:
    """New text (and its tokens and logprobs) for one choice."""

    choice: Choice
    text: str
    num_new_logprobs: int
    finished: bool


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
        self.choices: dict[str, Choice] = {}
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
            for i in range(sp.n):
                child_id = f"{request_id}-{prompt_index}-{i}"
                detok = IncrementalDetokenizer(tokenizer, prompt, sp.skip_special_tokens,
                                               sp.stop, sp.include_stop_str_in_output)
                choice = Choice(len(self.choices), prompt_index, detok)
                self.choices[child_id] = choice
                queue = broker.add_request(child_id, prompt, sp.for_sample(i), eos_token_id, engine)
                self._pumps.append(asyncio.create_task(self._pump(child_id, queue)))

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

    async def stream(self) -> AsyncIterator[Delta]:
        """Yields text deltas as they become final; returns when every choice finished."""
        unfinished = len(self.choices)
        try:
            while unfinished:
                child_id, item = await self._queue.get()
                if isinstance(item, Exception):
                    raise item
                if self.choices[child_id].finish_reason is not None:
                    continue  # ended by a stop string; its abort is on the way
                delta = self._apply(child_id, item)
                if delta.finished:
                    unfinished -= 1
                if delta.text or delta.num_new_logprobs or delta.finished:
                    yield delta
            self.timing.finished = time.monotonic()
        finally:
            self.abort_unfinished()

    def _apply(self, child_id: str, out: EngineCoreOutput) -> Delta:
        choice = self.choices[child_id]
        if out.finish_reason == "error":
            raise OpenAIError(400, str(out.stop_reason))
        if out.new_token_ids and self.timing.first_token is None:
            self.timing.first_token = time.monotonic()
        choice.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            choice.logprobs.append(out.new_logprobs)
        delta = choice.detokenizer.apply(out)
        if delta.abort:
            self.broker.abort([child_id])
        finished = delta.finish_reason is not None
        if finished:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        return Delta(choice, delta.text, 1 if out.new_logprobs is not None else 0, finished)

    def abort_unfinished(self) -> None:
        for task in self._pumps:
            task.cancel()
        pending = [cid for cid, c in self.choices.items() if c.finish_reason is None]
        if pending:
            self.broker.abort(pending)

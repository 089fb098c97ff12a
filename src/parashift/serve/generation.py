"""One HTTP request's generation: its prompts x n samples become engine requests; their token
deltas come back merged, detokenized and cut at stop strings. While streaming, text that could
still turn out to be the start of a stop string is held back, so a stop string never leaks.

Failover: when the engine of a request dies before the request has streamed anything, the
request is sent again, once, to another live rank (waiting up to FAILOVER_WAIT_S for one, as
when a lockstep group restarts), never to the rank that died; the client sees only a later
first token. A request that is not streamed has shown nothing until it ends, so it starts
over even when it had tokens. A pinned request fails over too: the pin chose its first rank,
and the rank is gone. A stream that had sent tokens gets the engine's death as its error."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from parashift.engine.request_tracker import RequestTracker, SampleDelta
from parashift.serve.engine_client import EngineClient
from parashift.serve.engine_errors import (
    EngineDeadError,
    EngineUnavailableError,
    RequestFailedError,
)
from parashift.serve.openai_protocol import OpenAIError
from parashift.types.outputs import EngineCoreOutput
from parashift.types.sampling_params import SamplingParams

FAILOVER_WAIT_S = 30.0  # how long a failover waits for a live rank (a lockstep restart)


@dataclass
class Timing:
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None


class Generation:
    def __init__(self, engines: EngineClient, tokenizer: Any, request_id: str,
                 prompts: list[list[int]], params: list[SamplingParams],
                 eos_token_id: int | None, rank: int | None, streamed: bool = False,
                 on_failover: Callable[[str], None] | None = None):
        self.engines = engines
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.streamed = streamed
        self.on_failover = on_failover  # hook(outcome): "resent" or "failed", for metrics
        self.timing = Timing()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._attempt = 0  # items of an earlier attempt's requests are stale
        self._shown = False  # a delta with tokens went out to the client
        self._track()
        self.engine = engines.pick_engine(rank, prompts=prompts)
        try:
            try:
                self._send_all()
            except EngineUnavailableError:  # it died before the engines heard: the next rank
                self.abort_unfinished()
                self.engine = engines.pick_engine(exclude=self.engine, prompts=prompts)
                self._attempt = 1
                self._send_all()
                self._count("resent")
        except BaseException:
            self.abort_unfinished()  # never leave half a request in flight
            raise

    def _track(self) -> None:
        """A fresh tracker of every sample (again after a failover that starts over)."""
        self.tracker = RequestTracker(self.tokenizer)
        self.choices = self.tracker.samples  # sample id -> Sample (one per choice)
        self._samples: dict[str, tuple[list[int], SamplingParams]] = {}
        # prompt index -> its tokens the prefix cache served, from each sample's first output
        # (a preempted sample's re-admission would count its own blocks)
        self._cached: dict[int, int] = {}
        self._seen: set[str] = set()
        for prompt_index, (prompt, sp) in enumerate(zip(self.prompts, self.params,
                                                        strict=True)):
            # n == 1 still gets its own id: every choice of the request is told apart.
            prompt_id = f"{self.request_id}-{prompt_index}" + ("-0" if sp.n == 1 else "")
            for sample_id, sample_params in self.tracker.add_prompt(prompt_id, prompt_index,
                                                                    prompt, sp):
                self._samples[sample_id] = (prompt, sample_params)

    def _send_all(self) -> None:
        for sample_id, (prompt, params) in self._samples.items():
            self.engines.add_request(sample_id, prompt, params, self.eos_token_id, self.engine,
                                    functools.partial(self._receive, self._attempt, sample_id))

    def _receive(self, attempt: int, child_id: str,
                 item: EngineCoreOutput | Exception) -> None:
        self._queue.put_nowait((attempt, child_id, item))

    async def _fail_over(self, error: EngineDeadError) -> None:
        """Send every sample again to a live rank other than the one that died, or raise."""
        dead = self.engine
        if self._attempt or (self.streamed and self._shown) or self.engines.num_engines < 2:
            self._count("failed")
            raise error
        deadline = time.monotonic() + FAILOVER_WAIT_S
        while True:
            try:
                self.engine = self.engines.pick_engine(exclude=dead, prompts=self.prompts)
                break
            except EngineUnavailableError:
                if time.monotonic() > deadline:
                    self._count("failed")
                    raise error from None
                await asyncio.sleep(0.1)
        self._attempt += 1
        if self.timing.first_token is not None:  # tokens the client never saw: start over
            self.timing.first_token = None
            self._track()
        try:
            self._send_all()
        except EngineUnavailableError:
            self._count("failed")
            raise error from None
        self._count("resent")

    def _count(self, outcome: str) -> None:
        if self.on_failover is not None:
            self.on_failover(outcome)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_cached_tokens(self) -> int:
        return sum(self._cached.values())

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    async def stream(self) -> AsyncIterator[SampleDelta]:
        """Yields text deltas as they become final; returns when every choice finished."""
        unfinished = len(self.choices)
        try:
            while unfinished:
                attempt, child_id, item = await self._queue.get()
                if attempt != self._attempt:
                    continue
                if isinstance(item, RequestFailedError):
                    raise OpenAIError(item.status, str(item), item.type)
                if isinstance(item, EngineDeadError):
                    await self._fail_over(item)
                    unfinished = len(self.choices)
                    continue
                if isinstance(item, Exception):
                    raise item
                delta = self._apply(item)
                if delta is None:
                    continue  # ended by a stop string; its abort is on the way
                if delta.finished:
                    unfinished -= 1
                if delta.text or delta.num_new_logprobs or delta.finished:
                    self._shown = self._shown or bool(delta.text or delta.num_new_logprobs)
                    yield delta
            self.timing.finished = time.monotonic()
        finally:
            self.abort_unfinished()

    def _apply(self, out: EngineCoreOutput) -> SampleDelta | None:
        if out.new_token_ids and self.timing.first_token is None:
            self.timing.first_token = time.monotonic()
        if out.request_id not in self._seen and out.request_id in self.choices:
            self._seen.add(out.request_id)
            prompt = self.choices[out.request_id].prompt_index
            self._cached[prompt] = max(self._cached.get(prompt, 0), out.num_cached_tokens)
        delta = self.tracker.apply(out)
        if delta is not None and delta.abort:
            self.engines.abort([out.request_id])
        return delta

    def abort_unfinished(self) -> None:
        pending = self.tracker.unfinished_ids()
        if pending:
            self.engines.abort(pending)

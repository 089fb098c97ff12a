"""One HTTP request's generation: its prompts x n samples become engine requests; their token
deltas come back merged, detokenized and cut at stop strings. While streaming, text that could
still turn out to be the start of a stop string is held back, so a stop string never leaks.

Outputs go into the request's tracker as they arrive (in the engine client's receive task),
and the stream reads what became final since its last read, merged per sample: a client that
reads slowly gets larger deltas, and the request holds its own samples, never a backlog of
messages (serve/sse.py drops a client that stops reading).

Overload: a rank whose waiting queue is full refuses a sample (429); before anything of the
request has reached the client, the whole request moves to the least loaded live rank that has
not refused it (a pinned one stays). Refused by all, it waits up to a second for room, and
then the client gets a 429 with Retry-After (serve/overload.py). With prefill/decode pools, a
sample whose decode phase every rank refused waits the same way, alone: its first token came,
its prompt's KV waits in the node's tier, and only that phase is sent again.

Scale-down: when the rank of a request starts draining, a request with no token yet starts
over on a serving rank; one with tokens runs on until the drain ends, and what is left then
fails over as from a dead rank.

Failover: when the engine of a request dies before the request has streamed anything, the
request is sent again, once, to another live rank (waiting up to FAILOVER_WAIT_S for one, as
when a lockstep group restarts), never to the rank that died; the client sees only a later
first token. A request that is not streamed has shown nothing until it ends, so it starts
over even when it had tokens. A pinned request fails over too: the pin chose its first rank,
and the rank is gone. A stream that had sent tokens gets the engine's death as its error."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from parashift.engine.request_tracker import RequestTracker, Sample, SampleDelta
from parashift.serve.engine_client import EngineClient
from parashift.serve.engine_errors import (
    DecodeRefusedError,
    EngineDeadError,
    EngineUnavailableError,
    RankDrainingError,
    RequestFailedError,
)
from parashift.serve.openai_protocol import OpenAIError
from parashift.serve.overload import HOLD_S, RetryLaterError
from parashift.types.outputs import EngineCoreOutput
from parashift.types.sampling_params import SamplingParams

FAILOVER_WAIT_S = 30.0  # how long a failover waits for a live rank (a lockstep restart)


@dataclass
class Timing:
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None


@dataclass
class _Unread:
    """What one sample made final since the stream last read it."""

    sample: Sample
    texts: list[str] = field(default_factory=list)
    num_new_logprobs: int = 0
    finished: bool = False

    def add(self, delta: SampleDelta) -> None:
        self.texts.append(delta.text)
        self.num_new_logprobs += delta.num_new_logprobs
        self.finished = self.finished or delta.finished

    def delta(self) -> SampleDelta:  # its abort, if any, went out when it arrived
        return SampleDelta(self.sample, "".join(self.texts), self.num_new_logprobs,
                           self.finished, False)


class Generation:
    def __init__(self, engines: EngineClient, tokenizer: Any, request_id: str,
                 prompts: list[list[int]], params: list[SamplingParams],
                 eos_token_id: int | None, rank: int | None, streamed: bool = False,
                 on_failover: Callable[[str], None] | None = None,
                 hashes: Sequence[Sequence[int]] = ()):
        self.engines = engines
        self.hashes = hashes  # what the router routes it by (EngineClient.route_hashes)
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.streamed = streamed
        self.pinned = rank is not None
        self.on_failover = on_failover  # hook(outcome): "resent" or "failed", for metrics
        self.timing = Timing()
        self._arrived = asyncio.Event()  # something for the stream to read
        self._unread: dict[str, _Unread] = {}  # sample id -> what it has not read yet
        self._error: Exception | None = None  # the current attempt's first failure, unread
        self._attempt = 0  # arrivals from an earlier attempt's requests are stale
        self._failed_over = False  # a request fails over once
        self._refused: set[int] = set()  # ranks whose full queues refused it
        self._hold_until: float | None = None  # refused by all: until when it waits for room
        self._decodes_refused: list[DecodeRefusedError] = []  # samples waiting to decode
        self._woken = False  # a freed slot woke it while it waited
        self._shown = False  # a delta with tokens went out to the client
        self._track()
        self.engine = self._pick(pinned=rank)
        try:
            try:
                self._send_all()
            except EngineUnavailableError:  # it died before the engines heard: the next rank
                self._failed_over = True
                self._restart(self._pick(exclude=self.engine))
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
            self.engines.add_request(self._wire_id(sample_id), prompt, params,
                                     self.eos_token_id, self.engine,
                                     functools.partial(self._receive, self._attempt, sample_id),
                                     whole=self.pinned)

    def _wire_id(self, sample_id: str) -> str:
        # An attempt's own: an earlier one's outputs still on the way never reach it (the
        # engine client forgot those ids) and no engine sees an id reused while it may hold it.
        return sample_id if self._attempt == 0 else f"{sample_id}.{self._attempt}"

    def _restart(self, rank: int) -> None:
        """Every sample again, on `rank`, as a new attempt; what the client never saw is
        dropped (the tokens of a request that is not streamed, or not streamed yet)."""
        self.abort_unfinished()
        self._attempt += 1
        self.engine = rank
        self._unread.clear()
        self._error = None
        self._decodes_refused.clear()
        if self.timing.first_token is not None:
            self.timing.first_token = None
            self._track()
        self._send_all()

    def _receive(self, attempt: int, sample_id: str,
                 item: EngineCoreOutput | Exception) -> None:
        """In the engine client's receive task: never blocks, and a bug here fails this
        request alone."""
        if attempt != self._attempt:
            return
        if isinstance(item, DecodeRefusedError):
            self._decodes_refused.append(item)
            self._arrived.set()
            return
        if not isinstance(item, Exception):
            try:
                delta = self._apply(sample_id, item)
            except Exception as e:  # the stream raises it: a 500 for this request alone
                item = e
            else:
                if delta is None or not (delta.text or delta.num_new_logprobs or
                                         delta.finished):
                    return  # nothing final yet (text held back), or late after a stop string
                self._unread.setdefault(sample_id, _Unread(delta.sample)).add(delta)
        # A drain's notice is no failure: a failure heard before the notice was read wins.
        if isinstance(item, Exception) and (self._error is None
                                            or isinstance(self._error, RankDrainingError)):
            self._error = item
        self._arrived.set()

    async def _recover(self, error: Exception) -> None:
        """The current attempt failed: move or fail over the request, or raise."""
        if isinstance(error, RequestFailedError):
            if error.status != 429:
                raise OpenAIError(error.status, str(error), error.type)
            await self._move(error)
        elif isinstance(error, EngineDeadError):
            await self._fail_over(error)
        elif isinstance(error, RankDrainingError):
            await self._leave_draining_rank(error)
        else:
            raise error

    async def _leave_draining_rank(self, error: RankDrainingError) -> None:
        """Its rank is leaving (a scale-down): a request with no token yet starts over on a
        serving rank (waiting up to FAILOVER_WAIT_S for one); one that has tokens keeps
        running there until the drain ends (then, if it is not done, `_fail_over`)."""
        if self.timing.first_token is not None:
            return
        deadline = time.monotonic() + FAILOVER_WAIT_S
        while True:
            try:
                self._restart(self._pick(exclude=self.engine))
                return
            except EngineUnavailableError:
                if time.monotonic() > deadline:
                    raise EngineDeadError(str(error)) from None
                await asyncio.sleep(0.1)

    async def _move(self, error: RequestFailedError) -> None:
        """A full rank refused it: the least loaded live rank that has not refused it yet;
        when all have, it waits for room (serve/overload.py) and tries again; in the end a
        429 that says when to retry."""
        self._refused.add(self.engine)
        self.abort_unfinished()  # its samples the rank did take: they run again elsewhere
        while not (self.streamed and self._shown):
            rank = self._rank_with_room()
            if rank is not None:
                try:
                    self._restart(rank)
                    return
                except EngineUnavailableError:  # gone since it was picked
                    self._refused.add(rank)
                    continue
            if self._hold_until is None:
                self._hold_until = time.monotonic() + HOLD_S
            left = self._hold_until - time.monotonic()
            if left <= 0 or not await self.engines.loads.room.wait(left, first=self._woken):
                break
            self._woken = True
            self._refused.clear()  # a request finished: its rank has room now
        where = (f"the pinned rank dp{self.engine}" if self.pinned
                 else "every live rank's waiting queue is full")
        raise RetryLaterError(f"{error} ({where})", self._retry_after()) from None

    async def _resume_decodes(self) -> None:
        """Every rank refused some samples' decode phases: each goes on once a slot frees,
        within the request's hold for room; then a 429 that says when to retry (an error
        event, once the client has seen tokens)."""
        if self._hold_until is None:
            self._hold_until = time.monotonic() + HOLD_S
        while self._decodes_refused:
            left = self._hold_until - time.monotonic()
            if left <= 0 or not await self.engines.loads.room.wait(left, first=self._woken):
                error = self._decodes_refused[0]
                raise RetryLaterError(f"{error} (the decode phase)", self._retry_after()
                                      ) from None
            self._woken = True
            self._decodes_refused.pop(0).resume()

    def _pick(self, pinned: int | None = None, exclude: int | Collection[int] = ()) -> int:
        """The engine client's choice for this request's prompts."""
        return self.engines.pick_engine(pinned, exclude, self.hashes)

    def _rank_with_room(self) -> int | None:
        if self.pinned:
            return None if self.engine in self._refused else self.engine
        try:
            return self._pick(exclude=self._refused)
        except EngineUnavailableError:
            return None

    def _retry_after(self) -> float:
        full = [self.engine] if self.pinned else self.engines.alive_engines()
        return self.engines.loads.retry_after(full)

    async def _fail_over(self, error: EngineDeadError) -> None:
        """Send every sample again to a live rank other than the one that died, or raise."""
        dead = self.engine if error.rank is None else error.rank  # (a decode rank: its own)
        if self._failed_over or (self.streamed and self._shown) or self.engines.num_engines < 2:
            self._count("failed")
            raise error
        deadline = time.monotonic() + FAILOVER_WAIT_S
        while True:
            try:
                rank = self._pick(exclude=dead)
                break
            except EngineUnavailableError:
                if time.monotonic() > deadline:
                    self._count("failed")
                    raise error from None
                await asyncio.sleep(0.1)
        self._failed_over = True
        try:
            self._restart(rank)
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
        """Yields, per sample, the text and logprobs that became final since the last read;
        returns when every choice finished."""
        try:
            while True:
                if self._error is not None:
                    error, self._error = self._error, None
                    await self._recover(error)
                elif self._unread:
                    unread, self._unread = self._unread, {}
                    for pending in unread.values():
                        delta = pending.delta()
                        self._shown = self._shown or bool(delta.text or delta.num_new_logprobs)
                        yield delta
                elif self._decodes_refused:
                    await self._resume_decodes()
                elif self.tracker.num_unfinished:
                    self._arrived.clear()
                    await self._arrived.wait()
                else:
                    break
            self.timing.finished = time.monotonic()
        finally:
            self.abort_unfinished()

    def _apply(self, sample_id: str, out: EngineCoreOutput) -> SampleDelta | None:
        wire_id = out.request_id  # the attempt's id; the tracker knows the sample's
        if wire_id != sample_id:
            out = dataclasses.replace(out, request_id=sample_id)
        if out.new_token_ids and self.timing.first_token is None:
            self.timing.first_token = time.monotonic()
        if sample_id not in self._seen and sample_id in self.choices:
            self._seen.add(sample_id)
            prompt = self.choices[sample_id].prompt_index
            self._cached[prompt] = max(self._cached.get(prompt, 0), out.num_cached_tokens)
        delta = self.tracker.apply(out)
        if delta is not None and delta.abort:
            self.engines.abort([wire_id])
        return delta

    def abort_unfinished(self) -> None:
        pending = [self._wire_id(s) for s in self.tracker.unfinished_ids()]
        if pending:
            self.engines.abort(pending)

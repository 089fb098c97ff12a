"""Continuous batching with chunked prefill.

Each step has a token budget and a sequence cap. Running requests go first (a decode token, or
the next chunk of an unfinished prefill); waiting requests are then admitted into what is
left, starting after their longest cached prefix. When the KV pool runs dry the most recently
admitted running request is preempted: its blocks are freed and it is recomputed later.

The engine may keep several batches in flight (engine/core.py). With async scheduling a request
whose step is in flight is scheduled again at once: the token that step will sample is a
placeholder (`num_output_placeholders`), which the runner fills from its own sampled ids, and
which becomes a real token when the step's output arrives. Without placeholders (a pipeline,
whose first stage cannot know what the last one samples) a request is in at most one batch: its
next step is scheduled only once its previous one returned, so each new batch is made of the
other requests, and each takes about an equal share of the tokens to run, so that the batches
in flight keep every stage equally busy. Either way a request preempted or aborted while in
flight keeps its place in no batch, and the stale result is dropped when it returns: a
finished request never emits a token from a step scheduled before it finished."""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterable

from parashift.config import SchedulerConfig
from parashift.engine.kv_cache import KVCacheManager
from parashift.engine.request import Request, RequestStatus
from parashift.engine.structured_output import fill_bitmask
from parashift.types.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)


class QueueFullError(ValueError):
    """A new request past --max-waiting-requests (the API server answers 429)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 max_batches_in_flight: int = 1, vocab_size: int = 0,
                 placeholders: bool = False):
        self.config = config
        self.vocab_size = vocab_size  # the bitmask's width, for structured outputs
        self.kv_cache = kv_cache
        self.max_batches_in_flight = max_batches_in_flight
        self.placeholders = placeholders  # async scheduling: schedule in-flight requests again
        # Requests of batches submitted and not yet returned: in how many. (One step at a
        # time none is in flight when the scheduler runs: it keeps no count.)
        self.in_flight: Counter[str] = Counter()
        self.num_preemptions = 0
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests whose runner-side state must be dropped at the next step.
        self._freed_req_ids: set[str] = set()
        # How many of each running request's tokens the model runner already holds.
        self._num_synced_tokens: dict[str, int] = {}
        # Finished without a step (a constraint that failed to compile): told at the next one.
        self._finished_unscheduled: list[EngineCoreOutput] = []

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(f"the engine's waiting queue is full ({limit} requests, "
                                 "--max-waiting-requests): try again later")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _batch_token_target(self) -> int:
        """How many tokens this batch should hold: the step budget without a pipeline. With
        one, the requests' next steps (a decode token, or what is left of the prompt; a request
        in flight counts its step after that one) spread evenly over the batches of a round
        through the pipeline, so that a big batch is not followed by a tiny one while a stage
        waits. Requests join whole until the target is reached (cutting a prompt to balance
        would only serialise it: its halves cannot be in flight together)."""
        budget, depth = self.config.max_num_batched_tokens, self.max_batches_in_flight
        if depth == 1 or self.placeholders:
            return budget
        work = 0
        for req in itertools.chain(self.running, self.waiting):
            if work >= depth * budget:
                break
            work += max(1, req.num_tokens - req.num_computed_tokens)
        return max(1, min(budget, -(-work // depth)))

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        stop_at = budget - self._batch_token_target()  # what is left when the batch is full
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        pending_grammar = False  # a constrained row samples after an unknown token
        i = 0
        while i < len(self.running) and budget > stop_at:
            req = self.running[i]
            if req.request_id in self.in_flight and not self._may_run_ahead(req):
                i += 1
                continue
            num_new = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens,
                          budget)
            pending_grammar |= req.grammar is not None and req.num_output_placeholders > 0
            new_block_ids = self.kv_cache.allocate_slots(req, num_new)
            while new_block_ids is None:
                victim = self._preemption_victim(i)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                new_block_ids = self.kv_cache.allocate_slots(req, num_new)
            if new_block_ids is None:
                break
            synced = self._num_synced_tokens[req.request_id]
            cached_reqs.append(CachedRequestData(
                req.request_id, req.all_token_ids[synced:], new_block_ids,
                req.num_computed_tokens, synced,
            ))
            self._num_synced_tokens[req.request_id] = req.num_tokens
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        # No admissions in a step that had to preempt: the pool is already too tight.
        compiling: list[Request] = []  # their grammar is not ready: the others go first
        while (not preempted and self.waiting and budget > stop_at
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.request_id in self.in_flight:  # preempted while its batch runs
                break
            if req.grammar is not None and not req.grammar.ready:
                compiling.append(self.waiting.popleft())
                continue
            if req.grammar is not None and req.grammar.error is not None:
                self.waiting.popleft()
                self._finish_unscheduled(req, req.grammar.error)
                continue
            computed_blocks, num_hit = self.kv_cache.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, budget)
            if not self.config.enable_chunked_prefill and num_new < req.num_tokens - num_hit:
                break
            if self.kv_cache.allocate_slots(req, num_new, computed_blocks) is None:
                break
            self.waiting.popleft()
            self.kv_cache.record_admission(req.num_tokens, num_hit)
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self.running.append(req)
            new_reqs.append(NewRequestData(
                req.request_id, list(req.all_token_ids), req.num_prompt_tokens, req.params,
                self.kv_cache.block_ids(req.request_id), num_hit,
            ))
            self._num_synced_tokens[req.request_id] = req.num_tokens
            num_scheduled[req.request_id] = num_new
            budget -= num_new

        self.waiting.extendleft(reversed(compiling))
        constrained = []
        for req_id, num_new in num_scheduled.items():
            req = self.requests[req_id]
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1  # it samples this step
                if req.grammar is not None:
                    constrained.append(req_id)
        if self.max_batches_in_flight > 1:
            self.in_flight.update(num_scheduled.keys())
        freed, self._freed_req_ids = self._freed_req_ids, set()
        out = SchedulerOutput(new_reqs, cached_reqs, num_scheduled, sum(num_scheduled.values()),
                              freed)
        if pending_grammar:  # as vLLM: the mask is made once the in-flight tokens are in
            out.deferred_grammar_req_ids = constrained
        else:
            out.grammar = self._bitmask(constrained)
        return out

    def _may_run_ahead(self, req: Request) -> bool:
        """Async scheduling: whether a request in flight is scheduled again now. Not when the
        tokens in flight already reach its length limits (the step would be thrown away)."""
        if not self.placeholders:
            return False
        num_outputs = req.num_output_tokens + req.num_output_placeholders
        max_tokens = req.params.max_tokens
        return ((max_tokens is None or num_outputs < max_tokens)
                and req.num_tokens + req.num_output_placeholders < self.config.max_model_len)

    def _bitmask(self, req_ids: list[str]):
        """The grammar rows of the constrained requests that sample in a batch; a request that
        finished or was preempted since has none (its token will be dropped)."""
        states = [(r, req.grammar) for r in req_ids
                  if (req := self.requests.get(r)) is not None
                  and req.status == RequestStatus.RUNNING and req.grammar is not None]
        return fill_bitmask(states, self.vocab_size)

    def deferred_bitmask(self, scheduler_output: SchedulerOutput):
        """The mask of a batch scheduled with placeholders, once the batches before it have
        returned and their tokens moved its requests' grammars on."""
        return self._bitmask(scheduler_output.deferred_grammar_req_ids or [])

    def _finish_unscheduled(self, req: Request, error: str) -> None:
        self._finish(req, RequestStatus.FINISHED_ABORTED, already_removed=True)
        self._finished_unscheduled.append(EngineCoreOutput(
            req.request_id, [], None, RequestStatus.FINISHED_ABORTED.value, error))

    def take_unscheduled_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._finished_unscheduled = self._finished_unscheduled, []
        return outputs

    def _preemption_victim(self, i: int) -> Request:
        """The most recently admitted request after running[i] (those before it are in this
        batch already), preferring one not in flight: its step would be thrown away."""
        later = self.running[i + 1:]
        idle = next((r for r in reversed(later) if r.request_id not in self.in_flight), None)
        return idle or self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.kv_cache.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # the tokens in flight are dropped
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._forget(req.request_id)
        self.waiting.appendleft(req)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.take_unscheduled_outputs()
        if self.max_batches_in_flight > 1:
            self.in_flight -= Counter(scheduler_output.num_scheduled_tokens.keys())
        live, running = self.requests, RequestStatus.RUNNING
        logprobs = runner_output.logprobs
        for req_id, token_id in runner_output.sampled_token_ids.items():
            req = live.get(req_id)
            # Gone, or preempted while in flight: the token belongs to a discarded run.
            if req is None or req.status != running:
                continue
            req.num_output_placeholders -= 1
            req.append_output_token(token_id)
            status = req.check_stop(self.config.max_model_len)
            if req.grammar is not None and not req.grammar.accept(token_id):
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete, or stuck
            if status is not None:
                self._finish(req, status)
            outputs.append(EngineCoreOutput(
                req_id, [token_id], logprobs.get(req_id) if logprobs else None,
                status.value if status else None, req.stop_reason, req.num_cached_tokens))
        return outputs

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED, already_removed=True)

    def _finish(self, req: Request, status: RequestStatus, already_removed: bool = False) -> None:
        if not already_removed:
            self.running.remove(req)
        req.status = status
        req.num_output_placeholders = 0
        self.kv_cache.free(req)
        self._forget(req.request_id)
        del self.requests[req.request_id]

    def _forget(self, req_id: str) -> None:
        self._freed_req_ids.add(req_id)
        self._num_synced_tokens.pop(req_id, None)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.waiting), len(self.running), self.kv_cache.usage,
                              self.kv_cache.stats.queried_tokens, self.kv_cache.stats.hit_tokens,
                              self.num_preemptions, self.kv_cache.pool.num_resets)

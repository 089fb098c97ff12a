"""Continuous batching with chunked prefill.

Each step has a token budget and a sequence cap. `schedule` reads in three parts: the running
requests' tokens first (a decode token, or the next chunk of an unfinished prefill), then the
waiting requests are admitted into what is left, starting after their longest cached prefix,
then the step's output is built. When the KV pool runs dry the most recently admitted running
request is preempted: its blocks are freed and it is recomputed later.

A request's state is its RequestStatus (engine/request.py), one queue per waiting state; how
far a request may run ahead of its results (pipeline depth, async scheduling's placeholders)
is the run-ahead policy's to say (engine/run_ahead.py). A finished request never emits a
token from a step scheduled before it finished."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from parashift.config import SchedulerConfig
from parashift.engine.kv_cache import KVCacheManager
from parashift.engine.kv_connector import KVConnector, LoadStart
from parashift.engine.request import Request, RequestStatus
from parashift.engine.run_ahead import OneStep, run_ahead_policy
from parashift.engine.step_batch import StepBatch
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
                 placeholders: bool = False, connector: KVConnector | None = None):
        self.config = config
        self.connector = connector  # KV beyond the pool (tiers), or None
        self.vocab_size = vocab_size  # the bitmask's width, for structured outputs
        self.kv_cache = kv_cache
        self.run_ahead: OneStep = run_ahead_policy(max_batches_in_flight, placeholders,
                                                   config.max_model_len)
        self.num_preemptions = 0
        # Whether this step may take prefill work (a lockstep group's cadence says; else always)
        self.admits_prefill = True
        self.requests: dict[str, Request] = {}
        self.waiting_for_grammar: list[Request] = []
        self.waiting_for_kv: list[Request] = []
        self.sending_kv: list[Request] = []  # prefill pool: their KV stores still copying
        self.waiting: deque[Request] = deque()  # WAITING, and PREEMPTED at its head
        self.running: list[Request] = []
        # Requests whose runner-side state must be dropped at the next step.
        self._freed_req_ids: set[str] = set()
        # Finished without a step (a constraint that failed to compile): told at the next one.
        self._finished_unscheduled: list[EngineCoreOutput] = []

    @property
    def max_batches_in_flight(self) -> int:
        return self.run_ahead.depth

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_grammar) + len(self.waiting_for_kv)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar
                    or self.waiting_for_kv or self.sending_kv)

    def check_room(self, num_held: int = 0) -> None:
        """The one admission cap (--max-waiting-requests), over the requests waiting here and
        `num_held` more that wait outside (held while the engine sleeps)."""
        limit = self.config.max_waiting_requests
        if limit is not None and self.num_waiting + num_held >= limit:
            raise QueueFullError(f"the engine holds {limit} requests already, waiting "
                                 "(--max-waiting-requests): try again later")

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.check_room()
        self.requests[request.request_id] = request
        if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
            assert request.grammar is not None, "a constrained request without its compile"
            self.waiting_for_grammar.append(request)
        else:
            self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        self._settle_grammars()
        if self.connector is not None:
            self._settle_kv()
        budget = self.config.max_num_batched_tokens
        target = self.run_ahead.batch_token_target(budget, self._ready())
        batch = StepBatch(budget, budget - target)
        num_preemptions = self.num_preemptions
        self._schedule_running(batch)
        # No admissions in a step that had to preempt: the pool is already too tight.
        if self.num_preemptions == num_preemptions and self.admits_prefill:
            self._admit_waiting(batch)
        return self._output(batch)

    def _ready(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting

    def _settle_grammars(self) -> None:
        """Requests whose constraint compiled join the waiting queue in arrival order;
        those whose compile failed finish."""
        if not self.waiting_for_grammar:
            return
        still = []
        for req in self.waiting_for_grammar:
            if not req.grammar.ready:
                still.append(req)
            elif req.grammar.error is not None:
                self._finish_unscheduled(req, req.grammar.error)
            elif not all(req.grammar.accept(t) for t in req.output_token_ids):
                self._finish_unscheduled(req, "the tokens generated before it came here do "
                                              "not fit its constraint")
            else:
                req.grammar_compiled()
                self._enqueue_by_arrival(req)
        self.waiting_for_grammar = still

    def _settle_kv(self) -> None:
        """Requests whose blocks arrived (or failed to) wait for admission again, in order;
        those whose blocks were sent on finish."""
        for req in list(self.sending_kv):
            self._hand_off_if_sent(req, self._finished_unscheduled)
        for req in self.connector.settle():
            if req.status == RequestStatus.WAITING_FOR_KV:
                self.waiting_for_kv.remove(req)
                req.kv_arrived()
                if req.status == RequestStatus.PREEMPTED:
                    self.waiting.appendleft(req)
                else:
                    self._enqueue_by_arrival(req)

    def _enqueue_by_arrival(self, req: Request) -> None:
        """Behind the preempted requests and those that arrived before it."""
        at = len(self.waiting)
        while at and (ahead := self.waiting[at - 1]).status == RequestStatus.WAITING \
                and ahead.arrival_time > req.arrival_time:
            at -= 1
        self.waiting.insert(at, req)

    def _schedule_running(self, batch: StepBatch) -> None:
        """The running requests' next tokens, while the budget and the KV pool last."""
        run_ahead, kv_cache, running = self.run_ahead, self.kv_cache, self.running
        i = 0
        while i < len(running) and batch.has_room:
            req = running[i]
            if not run_ahead.may_schedule(req) or not (self.admits_prefill
                                                        or _decodes(req)):
                i += 1
                continue
            num_new = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens,
                          batch.budget)
            new_block_ids = kv_cache.allocate_slots(req, num_new)
            if new_block_ids is None:
                new_block_ids = self._preempt_for(req, i, num_new)
                if new_block_ids is None:
                    return
            batch.pending_grammar |= req.grammar is not None and req.num_output_placeholders > 0
            synced = req.num_synced_tokens
            batch.cached_reqs.append(CachedRequestData(
                req.request_id, req.all_token_ids[synced:], new_block_ids,
                req.num_computed_tokens, synced,
            ))
            req.num_synced_tokens = req.num_tokens
            batch.add(req, num_new)
            i += 1

    def has_prefill_work(self) -> bool:
        """Whether a request waits for admission or a running one has a prompt left."""
        return bool(self.waiting) or not all(map(_decodes, self.running))

    def _preempt_for(self, req: Request, i: int, num_new: int) -> list[int] | None:
        """Preempts the latest admitted requests until running[i] fits (its new blocks), or
        until it is preempted itself (None)."""
        while True:
            victim = self._preemption_victim(i)
            self.running.remove(victim)
            self._preempt(victim)
            if victim is req:
                return None
            new_block_ids = self.kv_cache.allocate_slots(req, num_new)
            if new_block_ids is not None:
                return new_block_ids

    def _admit_waiting(self, batch: StepBatch) -> None:
        waiting, kv_cache = self.waiting, self.kv_cache
        while (waiting and batch.has_room
               and len(self.running) < self.config.max_num_seqs):
            req = waiting[0]
            if req.num_in_flight:  # preempted while its batch runs
                break
            computed_blocks, num_hit = kv_cache.get_computed_blocks(req)
            if self.connector is not None:
                start = self.connector.begin_load(req, computed_blocks)
                if start is LoadStart.WAIT:
                    waiting.popleft()
                    req.wait_for_kv()
                    self.waiting_for_kv.append(req)
                    continue
                if start is LoadStart.NOW:  # its loaded blocks are prefix hits now
                    computed_blocks, num_hit = kv_cache.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit, batch.budget)
            if not self.config.enable_chunked_prefill and num_new < req.num_tokens - num_hit:
                break
            if kv_cache.allocate_slots(req, num_new, computed_blocks) is None:
                break
            waiting.popleft()
            if self.connector is not None:  # it holds the loaded blocks itself now
                self.connector.release(req)
            kv_cache.record_admission(req.num_tokens, num_hit)
            req.admit(num_hit)
            self.running.append(req)
            batch.new_reqs.append(NewRequestData(
                req.request_id, list(req.all_token_ids), req.num_prompt_tokens, req.params,
                kv_cache.block_ids(req.request_id), num_hit,
            ))
            batch.add(req, num_new)

    def _output(self, batch: StepBatch) -> SchedulerOutput:
        constrained, requests, connector = [], self.requests, self.connector
        scheduled = batch.num_scheduled
        for req_id, num_new in scheduled.items():
            req = requests[req_id]
            req.num_computed_tokens += num_new
            if connector is not None:
                connector.store(req)
            if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1  # it samples this step
                if req.grammar is not None:
                    constrained.append(req_id)
        if scheduled and self.run_ahead.depth > 1:
            self.run_ahead.submitted(requests[r] for r in scheduled)
        freed, self._freed_req_ids = self._freed_req_ids, set()
        out = SchedulerOutput(batch.new_reqs, batch.cached_reqs, scheduled,
                              sum(scheduled.values()), freed)
        if connector is not None:
            out.kv_jobs = connector.take_jobs()
        if batch.pending_grammar:  # as vLLM: the mask is made once the in-flight tokens are in
            out.deferred_grammar_req_ids = constrained
        else:
            out.grammar = self._bitmask(constrained)
        return out

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
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        self._finished_unscheduled.append(EngineCoreOutput(
            req.request_id, [], None, RequestStatus.FINISHED_ABORTED.value, error))

    def take_unscheduled_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._finished_unscheduled = self._finished_unscheduled, []
        return outputs

    def _preemption_victim(self, i: int) -> Request:
        """The most recently admitted request after running[i] (those before it are in this
        batch already), preferring one not in flight: its step would be thrown away."""
        later = self.running[i + 1:]
        idle = next((r for r in reversed(later) if not r.num_in_flight), None)
        return idle or self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.kv_cache.free(req)
        req.preempt()
        self.num_preemptions += 1
        self._freed_req_ids.add(req.request_id)
        self.waiting.appendleft(req)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.take_unscheduled_outputs()
        live, running = self.requests, RequestStatus.RUNNING
        if self.run_ahead.depth > 1:
            self.run_ahead.returned(req for r in scheduler_output.num_scheduled_tokens
                                    if (req := live.get(r)) is not None)
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
                self.running.remove(req)
                self._finish(req, status)
            elif req.hands_off:
                self.running.remove(req)
                self._send_kv(req)
            outputs.append(EngineCoreOutput(
                req_id, [token_id], logprobs.get(req_id) if logprobs else None,
                status.value if status else None, req.stop_reason, req.num_cached_tokens))
            if req.status == RequestStatus.SENDING_KV:  # its last blocks copied in the step
                self._hand_off_if_sent(req, outputs)
        return outputs

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.waiting_for_grammar.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_KV:
                self.waiting_for_kv.remove(req)
            elif req.status == RequestStatus.SENDING_KV:
                self.sending_kv.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)

    def _send_kv(self, req: Request) -> None:
        """Its first token is out and its decode goes on in another engine: its prompt's
        blocks are stored (those a step could not store yet, now), and it finishes once the
        stores are published: in this step when they were urgent, else at a later one
        (`_settle_kv`). The stores hold their own blocks."""
        self.connector.store(req)  # (a request that hands off has one: EngineCore)
        req.send_kv()
        self.kv_cache.free(req)
        self._freed_req_ids.add(req.request_id)
        self.sending_kv.append(req)

    def _hand_off_if_sent(self, req: Request, outputs: list[EngineCoreOutput]) -> None:
        """Its stores are published: it finishes as handed off, told in `outputs`."""
        if self.connector.storing(req.request_id):
            return
        self.sending_kv.remove(req)
        self._finish(req, RequestStatus.FINISHED_HANDED_OFF)
        outputs.append(EngineCoreOutput(req.request_id, [], None, req.status.value, None,
                                        req.num_cached_tokens))

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Out of its queue already: its blocks and its runner state go."""
        req.finish(status)
        self.kv_cache.free(req)
        if self.connector is not None:
            self.connector.forget(req)
        self._freed_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    def stats(self) -> SchedulerStats:
        return SchedulerStats(self.num_waiting, len(self.running), self.kv_cache.usage,
                              self.kv_cache.stats.queried_tokens, self.kv_cache.stats.hit_tokens,
                              self.num_preemptions, self.kv_cache.pool.num_resets,
                              self.connector.stats if self.connector is not None else None)

    def tokens_left(self) -> tuple[int, int]:
        """The prompt tokens still to compute and the output tokens still allowed, over every
        request it holds (a preempted one computes its prompt again). Linear in the requests:
        the engine reports it with its load, not every step."""
        prefill = output = 0
        max_len = self.config.max_model_len
        for req in self.requests.values():
            if req.status == RequestStatus.SENDING_KV:  # its decode goes on elsewhere
                continue
            prefill += max(0, req.num_prompt_tokens - req.num_computed_tokens)
            allowed = max_len - req.num_prompt_tokens
            if req.params.max_tokens is not None:
                allowed = min(allowed, req.params.max_tokens)
            output += max(0, allowed - req.num_output_tokens)
        return prefill, output


def _decodes(req: Request) -> bool:
    """Whether its next step is one token (a decode), not a prompt's chunk."""
    return req.num_tokens + req.num_output_placeholders - req.num_computed_tokens <= 1

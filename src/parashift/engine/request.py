"""A request as the engine core sees it: token ids, progress and its KV block hashes."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from parashift.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from parashift.engine.structured_output import GrammarState


def check_prompt_tokens(token_ids: list[int], vocab_size: int) -> None:
    """Raises ValueError for a prompt no model step can run: empty, or a token id past the
    embedding (which would crash the step of every request batched with it)."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is outside the vocabulary "
                         f"(0..{vocab_size - 1})")


def check_handed_over(request: Request, vocab_size: int, max_model_len: int) -> None:
    """Raises ValueError for a request continued from another engine that could not go on
    here: its earlier tokens out of the vocabulary, or no room left for one more."""
    generated = request.output_token_ids
    if request.hands_off and generated:
        raise ValueError("a request cannot both hand its KV off and continue another's")
    if not generated:
        return
    if min(generated) < 0 or max(generated) >= vocab_size:
        raise ValueError(f"a generated token id is outside the vocabulary (0..{vocab_size - 1})")
    max_tokens = request.params.max_tokens
    if request.num_tokens >= max_model_len or (max_tokens is not None
                                               and len(generated) >= max_tokens):
        raise ValueError(f"the request has no token left to generate ({len(generated)} "
                         f"generated, max_tokens {max_tokens}, max_model_len {max_model_len})")


class RequestStatus(enum.Enum):
    """A request's state in the engine core (vLLM's RequestStatus names; docs/architecture.md
    draws the machine). Each transition is one method of Request; the scheduler keeps a
    queue per state that waits (`waiting_for_grammar`, `waiting`) and the running list.

    The states the next capabilities add go here, each with its transition methods and
    the scheduler function that moves requests out of it: for a rank that drains, a request
    moved to another rank leaves as FINISHED_ABORTED with a reason."""

    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its constraint compiles (vLLM: WAITING_FOR_FSM)
    # Its blocks load from a KV tier (a KV connector, engine/kv_connector.py); it waits for
    # admission again once they are in (vLLM: WAITING_FOR_REMOTE_KVS).
    WAITING_FOR_KV = "waiting_for_kv"
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, its KV freed; recomputed on resume
    # A prefill pool's request after its first token: its prompt's KV blocks are stored for a
    # decode rank (through the KV connector); it finishes once they are published.
    SENDING_KV = "sending_kv"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_HANDED_OFF = "handoff"  # its decode goes on elsewhere (the API server's to route)

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_HANDED_OFF}
# Every transition the machine has: from -> the states it may go to.
TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    RequestStatus.WAITING_FOR_GRAMMAR: frozenset({RequestStatus.WAITING,
                                                   RequestStatus.FINISHED_ABORTED}),
    RequestStatus.WAITING: frozenset({RequestStatus.RUNNING, RequestStatus.WAITING_FOR_KV,
                                      RequestStatus.FINISHED_ABORTED}),
    RequestStatus.PREEMPTED: frozenset({RequestStatus.RUNNING, RequestStatus.WAITING_FOR_KV,
                                         RequestStatus.FINISHED_ABORTED}),
    RequestStatus.WAITING_FOR_KV: frozenset({RequestStatus.WAITING, RequestStatus.PREEMPTED,
                                              RequestStatus.FINISHED_ABORTED}),
    RequestStatus.RUNNING: frozenset({RequestStatus.PREEMPTED, RequestStatus.SENDING_KV,
                                      *(_FINISHED - {RequestStatus.FINISHED_HANDED_OFF})}),
    RequestStatus.SENDING_KV: frozenset({RequestStatus.FINISHED_HANDED_OFF,
                                          RequestStatus.FINISHED_ABORTED}),
    **{status: frozenset() for status in _FINISHED},
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_id: int | None, arrival_time: float | None = None,
                 generated_token_ids: list[int] | None = None, hands_off: bool = False):
        """`generated_token_ids`: its output so far, sampled by another engine (a prefill
        rank's first token), continued here as if sampled here; `hands_off`: a prefill
        rank's request, which stops after its first token and sends its prompt's KV on."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = (RequestStatus.WAITING if params.structured_outputs is None
                       else RequestStatus.WAITING_FOR_GRAMMAR)
        self.output_token_ids: list[int] = list(generated_token_ids or ())
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.hands_off = hands_off
        self.num_computed_tokens = 0
        self.num_synced_tokens = 0  # of all_token_ids, how many the model runner holds
        self.num_in_flight = 0  # batches submitted with it and not yet returned
        # Tokens that steps in flight will sample, not known yet (async scheduling).
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.num_preemptions = 0
        self.kv_load_tried = False  # a KV connector loaded for it once (until a preemption)
        self._kv_resume = RequestStatus.WAITING  # the waiting state it left for WAITING_FOR_KV
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks
        # Its blocks are shared only with requests of the same salt (a tenant's).
        self.cache_salt = params.cache_salt
        # structured outputs: its compile, then its matcher (engine/structured_output.py)
        self.grammar: GrammarState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def _move(self, to: RequestStatus) -> None:
        assert to in TRANSITIONS[self.status], f"{self.request_id}: {self.status} -> {to}"
        self.status = to

    # --- the transitions ---------------------------------------------------------------------
    def grammar_compiled(self) -> None:
        """Its constraint is ready: it queues for admission."""
        self._move(RequestStatus.WAITING)

    def wait_for_kv(self) -> None:
        """Its blocks beyond the prefix hit load from a KV connector."""
        self._kv_resume = self.status
        self._move(RequestStatus.WAITING_FOR_KV)

    def kv_arrived(self) -> None:
        """Its load ended (the blocks that arrived are cached): it waits for admission."""
        self._move(self._kv_resume)

    def admit(self, num_hit_tokens: int) -> None:
        """Admitted to run, its first `num_hit_tokens` already in KV blocks (the prefix
        cache's; a resumed request's hits do not count as cached prompt tokens)."""
        if self.status == RequestStatus.WAITING:
            self.num_cached_tokens = num_hit_tokens
        self._move(RequestStatus.RUNNING)
        self.num_computed_tokens = num_hit_tokens
        self.num_synced_tokens = self.num_tokens

    def preempt(self) -> None:
        """Its KV blocks were freed: it waits again and is recomputed from its tokens; the
        tokens its steps in flight sample are dropped."""
        self._move(RequestStatus.PREEMPTED)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_synced_tokens = 0
        self.num_preemptions += 1
        self.kv_load_tried = False

    def send_kv(self) -> None:
        """Its first token is out: its prompt's blocks go to the decode rank."""
        self._move(RequestStatus.SENDING_KV)
        self.num_output_placeholders = 0

    def finish(self, status: RequestStatus) -> None:
        self._move(status)
        self.num_output_placeholders = 0

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """After a new token: has the request reached a stop condition?"""
        token = self.output_token_ids[-1]
        params = self.params
        if not params.ignore_eos and token == self.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            self.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

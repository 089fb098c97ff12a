"""The request state machine (engine/request.py) and the scheduler's queue per waiting state:
every transition is a method checked against one table, a constrained request waits in
WAITING_FOR_GRAMMAR without holding up the others and then takes its place by arrival, a
failed compile finishes it, and the admission cap counts every waiting request."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from parashift.engine.request import TRANSITIONS, Request, RequestStatus
from parashift.engine.scheduler import QueueFullError
from parashift.types.sampling_params import SamplingParams
from parashift.types.structured_outputs import StructuredOutputsParams

from .test_scheduler import FakeRunner, assert_no_leaks, make_request, make_scheduler

S = RequestStatus


class CompileInFlight:
    """A GrammarState whose compile the test finishes (`ready`, `error`)."""

    def __init__(self) -> None:
        self.ready = False
        self.error: str | None = None


def constrained(request_id: str, prompt_len: int, arrival: float) -> Request:
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    req = Request(request_id, [1] * prompt_len, params, None, arrival)
    req.grammar = CompileInFlight()
    return req


def plain(request_id: str, prompt_len: int, max_tokens: int, arrival: float) -> Request:
    return Request(request_id, [2] * prompt_len, SamplingParams(max_tokens=max_tokens), None,
                   arrival)


def test_every_transition_is_in_the_table_and_no_other_is_taken():
    req = make_request("a", 4, 2)
    assert req.status == S.WAITING
    with pytest.raises(AssertionError):
        req.preempt()  # not running
    with pytest.raises(AssertionError):
        req.finish(S.FINISHED_STOPPED)  # a waiting request can only be aborted
    req.admit(3)
    assert (req.status, req.num_computed_tokens, req.num_cached_tokens) == (S.RUNNING, 3, 3)
    req.preempt()
    assert (req.status, req.num_computed_tokens, req.num_preemptions) == (S.PREEMPTED, 0, 1)
    req.admit(2)  # a resumed request's hits are not cached prompt tokens
    assert (req.status, req.num_cached_tokens) == (S.RUNNING, 3)
    req.finish(S.FINISHED_LENGTH)
    for to in S:
        assert to not in TRANSITIONS[S.FINISHED_LENGTH]
    with pytest.raises(AssertionError):
        req.finish(S.FINISHED_ABORTED)  # finished is final
    # The table names every state, and only finished states have no way out.
    assert set(TRANSITIONS) == set(S)
    assert {s for s, to in TRANSITIONS.items() if not to} == {s for s in S if s.is_finished}


def test_a_compiling_request_waits_in_its_own_state_and_takes_its_place_by_arrival():
    sched = make_scheduler(64, max_num_batched_tokens=4, max_num_seqs=1)
    runner = FakeRunner()
    a = constrained("a", 8, arrival=1.0)
    b, c = plain("b", 2, 2, arrival=2.0), plain("c", 2, 2, arrival=3.0)
    for req in (a, b, c):
        sched.add_request(req)
    assert a.status == S.WAITING_FOR_GRAMMAR and sched.waiting_for_grammar == [a]
    assert sched.stats().num_waiting == 3

    out = sched.schedule()  # a compiles: b goes first, not held up
    assert list(out.num_scheduled_tokens) == ["b"]
    a.grammar.ready = True
    sched.update_from_output(out, runner.execute(sched, out))
    while b.status == S.RUNNING:  # b finishes; its seat goes to a, which arrived before c
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(sched, out))
    out = sched.schedule()
    assert a.status == S.RUNNING and list(out.num_scheduled_tokens) == ["a"]
    assert list(sched.waiting) == [c] and not sched.waiting_for_grammar
    assert out.num_scheduled_tokens["a"] == 4  # a chunk: it samples (and masks) nothing yet
    sched.update_from_output(out, runner.execute(sched, out))
    sched.abort_requests(["a", "c"])
    runner.execute(sched, sched.schedule())
    assert_no_leaks(sched)


def test_a_failed_compile_finishes_the_request_with_its_error_and_an_abort_ends_a_wait():
    sched = make_scheduler(64)
    failed, aborted = constrained("f", 4, 1.0), constrained("x", 4, 2.0)
    sched.add_request(failed)
    sched.add_request(aborted)
    failed.grammar.ready, failed.grammar.error = True, "bad regex"
    assert sched.schedule().is_empty
    (out,) = sched.take_unscheduled_outputs()
    assert (out.request_id, out.finish_reason, out.stop_reason) == ("f", "abort", "bad regex")
    assert failed.status == S.FINISHED_ABORTED
    sched.abort_requests(["x"])
    assert aborted.status == S.FINISHED_ABORTED
    assert_no_leaks(sched)


def test_the_admission_cap_counts_compiling_and_held_requests():
    sched = make_scheduler(64)
    sched.config = dataclasses.replace(sched.config, max_waiting_requests=2)
    sched.add_request(constrained("a", 4, 1.0))
    sched.add_request(plain("b", 4, 2, 2.0))
    with pytest.raises(QueueFullError, match="holds 2 requests"):
        sched.add_request(plain("c", 4, 2, 3.0))
    sched.abort_requests(["b"])
    sched.check_room()  # one seat left
    with pytest.raises(QueueFullError):
        sched.check_room(num_held=1)  # held while asleep, outside the scheduler


def test_the_drawn_machine_is_the_table():
    """docs/architecture.md's state diagram draws exactly TRANSITIONS."""
    doc = pathlib.Path(__file__).parents[2] / "docs" / "architecture.md"
    drawn = set(re.findall(r"^\s*([A-Z_]+) --> ([A-Z_]+)", doc.read_text(), re.MULTILINE))
    table = {(a.name, b.name) for a, targets in TRANSITIONS.items() for b in targets}
    assert drawn == table, (drawn - table, table - drawn)

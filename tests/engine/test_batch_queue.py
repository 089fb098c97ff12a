"""The scheduler with a batch queue (pipeline parallel): up to `depth` batches in flight, and
no request in two of them. Driven like the engine core drives it: fill the queue, then take
the oldest batch's result. The fake runner executes each batch when it is submitted (workers
run steps in order) and samples a token that depends on the request's whole history, so a
bookkeeping slip changes the output; outputs must equal the queue-of-one run."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from parashift.engine.request import RequestStatus
from parashift.engine.run_ahead import Pipeline, Placeholders, run_ahead_policy
from parashift.types.outputs import ModelRunnerOutput, SchedulerOutput

from .test_scheduler import FakeRunner, assert_no_leaks, make_request, make_scheduler


class HistoryRunner(FakeRunner):
    """Samples (sum of the request's tokens) % 11: the next token depends on all before it."""

    def sample(self, req_id: str) -> int:
        return sum(self.batch.token_row(req_id)) % 11


def run(w: dict, depth: int, aborts: bool, placeholders: bool = False) -> dict[str, list[int]]:
    """Steps as the engine core does with `depth` batches in flight (placeholders: async
    scheduling's, with two); each request's outputs."""
    sched = make_scheduler(w["num_blocks"], w["block_size"], w["budget"], w["max_num_seqs"],
                           w["max_model_len"], w["prefix_caching"])
    sched.run_ahead = run_ahead_policy(depth, placeholders, w["max_model_len"])
    runner = HistoryRunner()
    reqs = [make_request(str(i), plen, max_tokens, first=variant)
            for i, (plen, max_tokens, variant) in enumerate(w["requests"])]
    for req in reqs:
        sched.add_request(req)
    queue: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    outputs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    done: set[str] = set()
    max_steps = 50 + 20 * sum(p + m for p, m, _ in w["requests"])
    for step_no in range(max_steps):
        if not (sched.has_unfinished_requests or queue):
            break
        if aborts:
            for abort_step, which in w["aborts"]:
                if abort_step == step_no and which < len(reqs):
                    sched.abort_requests([reqs[which].request_id])
                    done.add(reqs[which].request_id)
        while len(queue) < depth:
            out = sched.schedule()
            if out.is_empty and not out.freed_req_ids:
                break
            in_flight = [set(o.num_scheduled_tokens) for o, _ in queue]
            if not placeholders:
                assert all(not (ids & set(out.num_scheduled_tokens)) for ids in in_flight)
            assert out.total_num_scheduled_tokens <= w["budget"]
            for req_id in out.num_scheduled_tokens:  # a request past its limits never runs
                req = sched.requests[req_id]
                assert req.num_output_tokens < req.params.max_tokens
                assert req.num_tokens < w["max_model_len"] or req.num_computed_tokens < \
                    req.num_tokens + req.num_output_placeholders
            queue.append((out, runner.execute(sched, out)))
            if out.is_empty:  # sent only to drop freed requests in the workers
                break
        # Progress: with unfinished requests, something is in flight.
        assert queue or not sched.has_unfinished_requests
        for req in sched.requests.values() if depth > 1 else ():
            # each live request counts its batches in flight (one at a time: none is)
            assert req.num_in_flight == sum(req.request_id in o.num_scheduled_tokens
                                            for o, _ in queue)
        if not queue:
            continue
        out, result = queue.popleft()
        for o in sched.update_from_output(out, result):
            assert o.request_id not in done  # a finished request never emits a token again
            outputs[o.request_id].extend(o.new_token_ids)
            if o.finished:
                done.add(o.request_id)
    else:
        raise AssertionError(f"unfinished after {max_steps} steps")
    assert_no_leaks(sched)
    runner.execute(sched, sched.schedule())
    assert runner.batch.rows == {}  # the workers hold nothing of finished requests
    for req in reqs:
        assert req.status.is_finished and req.num_output_placeholders == 0
        if req.status != RequestStatus.FINISHED_ABORTED:
            assert outputs[req.request_id] == req.output_token_ids
            assert len(req.output_token_ids) <= req.params.max_tokens
    return outputs


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(4, 32))
    min_blocks = -(-max_model_len // block_size)
    requests = draw(st.lists(st.tuples(st.integers(1, max_model_len - 1), st.integers(1, 20),
                                       st.integers(0, 2)), min_size=1, max_size=8))
    return dict(block_size=block_size, max_model_len=max_model_len,
                num_blocks=draw(st.integers(min_blocks, min_blocks + 8)),  # preemption
                budget=draw(st.integers(1, 40)), max_num_seqs=draw(st.integers(1, 6)),
                prefix_caching=draw(st.booleans()), requests=requests,
                aborts=draw(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 7)),
                                     max_size=3)))


@settings(max_examples=150, deadline=None)
@given(w=workloads(), depth=st.integers(2, 4))
def test_batches_in_flight_never_share_a_request_and_match_the_queue_of_one(w, depth):
    assert run(w, depth, aborts=False) == run(w, 1, aborts=False)
    run(w, depth, aborts=True)  # aborts mid-flight: everything still finishes, no leaks


@settings(max_examples=150, deadline=None)
@given(w=workloads())
def test_placeholders_lose_no_token_and_never_outlive_their_request(w):
    """Async scheduling: each request in flight is scheduled again with a placeholder for the
    token in flight. The tokens are those of one step at a time (the runner's sample depends
    on every token before it), no finished request emits another, no block leaks."""
    assert run(w, 2, aborts=False, placeholders=True) == run(w, 1, aborts=False)
    run(w, 2, aborts=True, placeholders=True)


def test_batches_split_the_tokens_evenly_over_the_pipeline():
    sched = make_scheduler(64, max_num_seqs=8)
    sched.run_ahead = Pipeline(2, sched.config.max_model_len)
    for i in range(4):
        sched.add_request(make_request(str(i), 3, 5))
    first, second = sched.schedule(), sched.schedule()
    assert len(first.num_scheduled_tokens) == len(second.num_scheduled_tokens) == 2
    assert sched.schedule().is_empty  # everything is in flight: nothing to add


def test_a_small_batch_in_flight_gets_a_big_partner():
    sched = make_scheduler(256, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    sched.run_ahead = Pipeline(2, sched.config.max_model_len)
    for i in range(4):
        sched.add_request(make_request(str(i), 30, 5, first=i))
    first = sched.schedule()  # 120 tokens ready over 2 batches: 60 each, not 64 + 56
    assert first.total_num_scheduled_tokens == 60
    assert sched.schedule().total_num_scheduled_tokens == 60
    sched.update_from_output(first, ModelRunnerOutput({"0": 1, "1": 1}))
    # 60 tokens in flight, 2 decodes ready: the share is 31, all there is goes
    assert sched.schedule().num_scheduled_tokens == {"0": 1, "1": 1}


def test_a_request_in_flight_runs_ahead_on_a_placeholder_up_to_max_tokens():
    sched = make_scheduler(64)
    sched.run_ahead = Placeholders(2, sched.config.max_model_len)
    a = make_request("a", 3, 3)
    sched.add_request(a)
    first, second = sched.schedule(), sched.schedule()
    assert first.num_scheduled_tokens == {"a": 3} and second.num_scheduled_tokens == {"a": 1}
    assert second.cached_reqs[0].new_token_ids == []  # the runner fills the placeholder
    assert sched.requests["a"].num_output_placeholders == 2
    (out,) = sched.update_from_output(first, ModelRunnerOutput({"a": 5}))
    assert out.new_token_ids == [5]
    third = sched.schedule()  # the token in flight is the second of three
    assert third.num_scheduled_tokens == {"a": 1}
    assert third.cached_reqs[0].new_token_ids == [5] and third.cached_reqs[0].token_offset == 3
    assert sched.schedule().is_empty  # three tokens in flight or out: max_tokens is reached
    sched.update_from_output(second, ModelRunnerOutput({"a": 6}))
    (last,) = sched.update_from_output(third, ModelRunnerOutput({"a": 7}))
    assert last.finish_reason == "length" and a.num_in_flight == 0
    assert_no_leaks(sched)

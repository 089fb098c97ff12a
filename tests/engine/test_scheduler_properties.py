"""Property test of the Scheduler + KVCacheManager over random workloads (arrivals, aborts,
tiny block pools that force preemption, chunked or whole prefill, prefix caching): budgets are
respected, every request finishes with all its tokens, and no block leaks."""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from parashift.engine.request import RequestStatus

from .test_scheduler import (
    SAMPLED_TOKEN,
    FakeRunner,
    assert_no_leaks,
    make_request,
    make_scheduler,
    step,
)


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 40))
    min_blocks = -(-max_model_len // block_size)
    num_blocks = draw(st.integers(min_blocks, min_blocks + 6))  # tiny: forces preemption
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 48))
    if not chunked:
        budget = max(budget, max_model_len)
    requests = draw(st.lists(
        st.tuples(st.integers(1, max_model_len - 1),  # prompt length
                  st.integers(1, 30),  # max_tokens
                  st.integers(0, 2),  # prompt content variant (shared prefixes)
                  st.integers(0, 6)),  # arrival step
        min_size=1, max_size=10))
    aborts = draw(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=4))
    return dict(block_size=block_size, max_model_len=max_model_len, num_blocks=num_blocks,
                chunked=chunked, budget=budget, max_num_seqs=draw(st.integers(1, 6)),
                prefix_caching=draw(st.booleans()), requests=requests, aborts=aborts)


@settings(max_examples=200, deadline=None)
@given(w=workloads())
def test_random_workloads_respect_budgets_and_finish_without_leaks(w):
    sched = make_scheduler(w["num_blocks"], w["block_size"], w["budget"], w["max_num_seqs"],
                           w["max_model_len"], w["prefix_caching"], w["chunked"])
    runner = FakeRunner()
    reqs = [make_request(str(i), plen, max_tokens, first=variant)
            for i, (plen, max_tokens, variant, _) in enumerate(w["requests"])]
    by_id = {r.request_id: r for r in reqs}
    arrivals = [arrival for *_, arrival in w["requests"]]
    aborted: set[str] = set()
    preemptions = {r.request_id: 0 for r in reqs}
    max_steps = 50 + 20 * sum(p + m for p, m, *_ in w["requests"])

    for step_no in range(max_steps):
        for req, arrival in zip(reqs, arrivals, strict=True):
            if arrival == step_no:
                sched.add_request(req)
        for abort_step, which in w["aborts"]:
            if abort_step == step_no and which < len(reqs):
                req = reqs[which]
                if req.request_id in sched.requests:
                    aborted.add(req.request_id)
                sched.abort_requests([req.request_id])
        if step_no > max(arrivals) and not sched.has_unfinished_requests:
            break

        had_work = sched.has_unfinished_requests
        out, _ = step(sched, runner)
        # Progress: some request runs whenever any is unfinished (no livelock, no stall).
        assert out.is_empty != had_work
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= w["budget"]
        assert all(n > 0 for n in out.num_scheduled_tokens.values())
        assert len(sched.running) <= w["max_num_seqs"]
        assert len(out.num_scheduled_tokens) <= w["max_num_seqs"]
        for new in out.new_reqs:
            req = by_id[new.req_id]
            assert new.token_ids[:new.num_prompt_tokens] == req.prompt_token_ids
            assert new.num_computed_tokens % w["block_size"] == 0
            if not w["prefix_caching"]:
                assert new.num_computed_tokens == 0
        for req in reqs:
            if req.num_preemptions > preemptions[req.request_id]:
                preemptions[req.request_id] = req.num_preemptions
                # Preempted this step: blocks freed, back in the queue, to recompute from 0.
                assert req.request_id in out.freed_req_ids
                assert req.status == RequestStatus.PREEMPTED
                assert req.num_computed_tokens == 0
                assert req in sched.waiting
                assert req.request_id not in sched.kv_cache.req_blocks
    else:
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    for req, (plen, max_tokens, *_) in zip(reqs, w["requests"], strict=True):
        assert req.is_finished
        if req.request_id in aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH
            # No token lost or sampled twice across preemptions.
            expected = min(max_tokens, w["max_model_len"] - plen)
            assert req.output_token_ids == [SAMPLED_TOKEN] * expected
    event(f"preempted: {any(r.num_preemptions for r in reqs)}")
    event(f"prefix hits: {sched.stats().prefix_cache_hit_tokens > 0}")
    event(f"aborted: {bool(aborted)}")
    assert_no_leaks(sched)
    # The next step tells the runner to drop everything it still holds.
    out = sched.schedule()
    assert out.is_empty
    runner.execute(sched, out)
    assert runner.batch.num_reqs == 0 and runner.batch.rows == {}

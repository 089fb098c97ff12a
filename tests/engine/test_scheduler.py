"""Scheduler + KVCacheManager driven by a synthetic model runner: budgets, ordering, chunked
prefill, preemption, aborts and prefix hits, case by case (the property test over random
workloads is in test_scheduler_properties.py). Other files import the runner and helpers.

The runner here keeps its requests as the real ModelRunner does (executor/input_batch.py: the
same deltas applied, the same rule for which rows sample, its own sampled tokens kept) and
samples a fixed token: only the model is left out."""

from __future__ import annotations

import numpy as np

from parashift.config import SchedulerConfig
from parashift.engine.kv_cache import KVCacheManager
from parashift.engine.request import Request, RequestStatus
from parashift.engine.scheduler import Scheduler
from parashift.executor.input_batch import InputBatch
from parashift.types.outputs import ModelRunnerOutput, SchedulerOutput
from parashift.types.sampling_params import SamplingParams

SAMPLED_TOKEN = 7


class FakeRunner:
    """The runner side of the protocol, without a model."""

    def __init__(self) -> None:
        self.batch: InputBatch | None = None
        self.pending: list[int] | None = None  # the ids the batch's pending rows index

    def execute(self, sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
        if self.batch is None:  # few rows: the tests grow it
            self.batch = InputBatch(sched.config.max_model_len, sched.kv_cache.block_size, 2)
        batch = self.batch
        batch.apply(out)
        order = list(out.num_scheduled_tokens)
        rows = batch.rows_of(order)
        for req_id, row in zip(order, rows.tolist(), strict=True):
            req, num = sched.requests[req_id], out.num_scheduled_tokens[req_id]
            # The runner's view agrees with the scheduler's after applying the deltas.
            # (beyond the scheduler's tokens: those it sampled in steps still in flight)
            tokens = batch.token_row(req_id)
            assert tokens[: req.num_tokens] == req.all_token_ids
            assert len(tokens) <= req.num_tokens + req.num_output_placeholders
            assert batch.block_row(req_id) == sched.kv_cache.block_ids(req_id)
            assert batch.num_computed_tokens[row] + num == req.num_computed_tokens
            assert req.num_computed_tokens <= req.num_tokens + req.num_output_placeholders
            assert batch.num_blocks[row] * sched.kv_cache.block_size >= req.num_computed_tokens
        q_lens = np.array([out.num_scheduled_tokens[r] for r in order], dtype=np.int64)
        sampling = batch.advance(rows, batch.num_computed_tokens[rows] + q_lens)
        if self.pending is not None:  # as the runner: the last step's ids before sampling
            batch.resolve_pending(self.pending)
        sampled = {order[i]: self.sample(order[i]) for i in sampling.tolist()}
        batch.append_pending(rows[sampling])
        self.pending = list(sampled.values())
        return ModelRunnerOutput(sampled)

    def sample(self, req_id: str) -> int:
        return SAMPLED_TOKEN


def make_scheduler(num_blocks: int, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 8, max_model_len: int = 64,
                   enable_prefix_caching: bool = False,
                   enable_chunked_prefill: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len,
                             enable_chunked_prefill)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching))


def make_request(request_id: str, prompt_len: int, max_tokens: int, first: int = 0) -> Request:
    prompt = [(first + i) % 5 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), eos_token_id=None)


def step(sched: Scheduler, runner: FakeRunner):
    out = sched.schedule()
    return out, sched.update_from_output(out, runner.execute(sched, out))


def assert_no_leaks(sched: Scheduler) -> None:
    pool = sched.kv_cache.pool
    assert not sched.has_unfinished_requests and sched.requests == {}
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sched.kv_cache.req_blocks == {} and sched.kv_cache.num_cached_blocks == {}


# ---------------------------------------------------------------------------------------------
# Plain cases


def test_single_request_prefill_then_decode_to_length():
    sched, runner = make_scheduler(num_blocks=8), FakeRunner()
    req = make_request("a", prompt_len=6, max_tokens=3)
    sched.add_request(req)
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 6}
    assert [o.new_token_ids for o in outputs] == [[SAMPLED_TOKEN]]
    for expected_reason in (None, "length"):
        out, outputs = step(sched, runner)
        assert out.num_scheduled_tokens == {"a": 1}
        assert outputs[0].finish_reason == expected_reason
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == [SAMPLED_TOKEN] * 3
    assert_no_leaks(sched)
    assert sched.schedule().freed_req_ids == {"a"}  # the runner is told to drop it


def test_duplicate_request_id_rejected():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", 3, 1))
    try:
        sched.add_request(make_request("a", 3, 1))
    except ValueError as e:
        assert "already in use" in str(e)
    else:
        raise AssertionError("duplicate id accepted")


def test_chunked_prefill_splits_long_prompt():
    sched, runner = make_scheduler(num_blocks=8, max_num_batched_tokens=4), FakeRunner()
    sched.add_request(make_request("a", prompt_len=10, max_tokens=2))
    chunks, sampled_at = [], []
    for i in range(3):
        out, outputs = step(sched, runner)
        chunks.append(out.num_scheduled_tokens["a"])
        if outputs:
            sampled_at.append(i)
    assert chunks == [4, 4, 2]
    assert sampled_at == [2]  # only the step that completes the prompt samples


def test_without_chunked_prefill_prompt_goes_whole():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=16, max_model_len=16,
                           enable_chunked_prefill=False)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt_len=10, max_tokens=2))
    sched.add_request(make_request("b", prompt_len=10, max_tokens=2))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 10}  # b does not fit whole in the rest
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}


def test_decodes_scheduled_before_new_prefills():
    sched, runner = make_scheduler(num_blocks=32, max_num_batched_tokens=8), FakeRunner()
    sched.add_request(make_request("a", prompt_len=3, max_tokens=10))
    sched.add_request(make_request("b", prompt_len=4, max_tokens=10))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 3, "b": 4}
    sched.add_request(make_request("c", prompt_len=20, max_tokens=10))
    out, _ = step(sched, runner)
    # Both decodes first, then c's prefill gets only what is left of the budget.
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 6)]
    assert [r.req_id for r in out.cached_reqs] == ["a", "b"]
    assert [r.req_id for r in out.new_reqs] == ["c"]
    out, _ = step(sched, runner)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 6)]


def test_max_num_seqs_caps_running():
    sched, runner = make_scheduler(num_blocks=32, max_num_seqs=2), FakeRunner()
    for i in range(3):
        sched.add_request(make_request(str(i), prompt_len=3, max_tokens=2))
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"0", "1"}
    assert [r.request_id for r in sched.waiting] == ["2"]
    step(sched, runner)  # 0 and 1 finish
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"2": 3}


def test_preemption_frees_last_admitted_and_recomputes_from_zero():
    # 4 blocks of 4 tokens; two requests of 6 prompt tokens each hold 2 blocks; the first
    # one's growth past 8 tokens needs a third block, so the second is preempted.
    sched, runner = make_scheduler(num_blocks=4, max_model_len=16), FakeRunner()
    a, b = make_request("a", 6, 8), make_request("b", 6, 8, first=1)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    step(sched, runner)
    step(sched, runner)  # both at 8 tokens computed... a now needs its 3rd block
    out, _ = step(sched, runner)
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and "b" not in sched.kv_cache.req_blocks
    assert "b" in out.freed_req_ids and list(sched.waiting) == [b]
    assert out.num_scheduled_tokens == {"a": 1}
    outputs_before = list(b.output_token_ids)
    while a.request_id in sched.requests:
        out, _ = step(sched, runner)
    # b resumes with its prompt and outputs so far, recomputed from position 0.
    while not out.new_reqs:
        out, _ = step(sched, runner)
    (new,) = out.new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 0
    assert new.token_ids == b.prompt_token_ids + outputs_before
    assert out.num_scheduled_tokens["b"] == len(new.token_ids)
    while sched.has_unfinished_requests:
        step(sched, runner)
    assert b.output_token_ids == [SAMPLED_TOKEN] * 8
    assert_no_leaks(sched)


def test_abort_waiting_running_and_unknown():
    sched, runner = make_scheduler(num_blocks=16, max_num_seqs=1), FakeRunner()
    sched.add_request(make_request("a", 5, 10))
    sched.add_request(make_request("b", 5, 10))
    step(sched, runner)
    sched.abort_requests(["a", "b", "nope"])
    assert_no_leaks(sched)
    out, outputs = step(sched, runner)
    assert out.is_empty and outputs == [] and out.freed_req_ids == {"a", "b"}
    assert runner.batch.num_reqs == 0 and runner.batch.rows == {}


def test_prefix_hit_at_admission():
    sched = make_scheduler(num_blocks=16, enable_prefix_caching=True)
    runner = FakeRunner()
    sched.add_request(make_request("a", 10, 1))
    step(sched, runner)
    b = make_request("b", 10, 1)
    sched.add_request(b)
    out, _ = step(sched, runner)
    (new,) = out.new_reqs
    assert new.num_computed_tokens == 8 and out.num_scheduled_tokens == {"b": 2}
    assert b.num_cached_tokens == 8
    assert sched.stats().prefix_cache_hit_tokens == 8


def test_prefix_stats_count_each_admission_once():
    sched = make_scheduler(num_blocks=4, enable_prefix_caching=True)
    runner = FakeRunner()
    sched.add_request(make_request("p", 8, 1))
    step(sched, runner)  # p fills and frees 2 cached blocks
    sched.add_request(make_request("a", 9, 3, first=2))  # takes 3 of 4 blocks, keeps p's first
    b = make_request("b", 8, 1)  # hits p's first block but needs one more: must wait for a
    sched.add_request(b)
    waited = 0
    while b.status == RequestStatus.WAITING:
        step(sched, runner)
        waited += 1
    assert waited >= 2 and b.num_cached_tokens == 4
    # One admission with 4 cached tokens; p and a had none.
    assert sched.stats().prefix_cache_hit_tokens == 4
    assert sched.stats().prefix_cache_queried_tokens == 8 + 9 + 8


def test_the_engine_counts_prompt_tokens_to_compute_and_outputs_still_allowed():
    sched = make_scheduler(num_blocks=32, max_num_batched_tokens=8, max_model_len=64)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt_len=12, max_tokens=5))
    sched.add_request(make_request("b", prompt_len=60, max_tokens=30))  # 4 left in the model
    assert sched.tokens_left() == (72, 5 + 4)
    step(sched, runner)  # a's first 8-token chunk
    assert sched.tokens_left() == (64, 9)
    step(sched, runner)  # a's last 4 tokens and its first output; b's first 4 tokens
    assert sched.tokens_left() == (56, 8)

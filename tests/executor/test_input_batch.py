"""The model runner's persistent input batch (executor/input_batch.py) against a batch rebuilt
from scratch after every change: requests added, finished, preempted (re-added whole), given
new tokens (by the scheduler, or sampled by the runner and sent back later, or sampled and left
on the "device" as async scheduling's pending tokens) and new blocks, and scheduled in an
order that is not the rows' order. The rows, the sampling columns, the penalty counts and the
step's gathered inputs (pending tokens copied from the sampled ids) agree."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parashift.executor.input_batch import InputBatch
from parashift.executor.model_runner import ModelRunner
from parashift.executor.sampled_tokens import SampledTokens
from parashift.types.outputs import NewRequestData
from parashift.types.sampling_params import SamplingParams

MAX_MODEL_LEN, BLOCK = 64, 4
PARAMS = [SamplingParams(temperature=0.0),
          SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=3, logprobs=2),
          SamplingParams(temperature=1.0, min_p=0.1, frequency_penalty=0.5),
          SamplingParams(temperature=0.0, repetition_penalty=1.2)]

_ops = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 20), st.integers(0, len(PARAMS) - 1)),
    st.tuples(st.just("finish"), st.integers(0, 9)),
    st.tuples(st.just("preempt"), st.integers(0, 9)),
    # 0: the scheduler's token; 1: the runner samples, the scheduler echoes; 2: the runner's
    # sampled ids stay pending (the last step's are resolved first, as the runner does)
    st.tuples(st.just("decode"), st.integers(0, 2)),
    st.tuples(st.just("echo")),  # the scheduler's copy of the pending tokens
    st.tuples(st.just("chunk"), st.integers(1, 8)),
)


def rebuilt(requests: dict[str, dict]) -> InputBatch:
    batch = InputBatch(MAX_MODEL_LEN, BLOCK)
    for req_id, r in requests.items():
        batch.add(new_data(req_id, r))
    return batch


def new_data(req_id: str, r: dict) -> NewRequestData:
    return NewRequestData(req_id, list(r["tokens"]), r["prompt"], r["params"], list(r["blocks"]),
                          r["computed"])


def assert_same(batch: InputBatch, fresh: InputBatch, requests: dict[str, dict],
                sampled: list[int] | None) -> None:
    """`sampled`: the ids the pending rows index (on the "device")."""
    on_device = batch
    if sampled is not None:  # the host's view once they arrive
        batch = copy.deepcopy(batch)
        batch.resolve_pending(sampled)
    assert sorted(batch.rows.values()) == list(range(len(requests)))
    assert {batch.req_ids[row]: row for row in range(batch.num_reqs)} == batch.rows
    for req_id, r in requests.items():
        a, b = batch.rows[req_id], fresh.rows[req_id]
        assert batch.token_row(req_id) == fresh.token_row(req_id) == r["tokens"]
        assert batch.block_row(req_id) == fresh.block_row(req_id) == r["blocks"]
        for column in ("num_computed_tokens", "num_prompt_tokens", "temperature", "top_k",
                       "top_p", "min_p", "seeded", "has_logprobs"):
            assert getattr(batch, column)[a] == getattr(fresh, column)[b], column
        ca, cb = batch.counts[a], fresh.counts[b]
        assert (ca is None) == (cb is None)
        if ca is not None:
            assert dict(zip(ca.token_ids.tolist(), ca.output_counts.tolist(), strict=True)) == \
                dict(zip(cb.token_ids.tolist(), cb.output_counts.tolist(), strict=True))
    # The step's inputs (each request's uncomputed tokens), in another order than the rows'.
    order = [r for r in sorted(requests, reverse=True)
             if len(requests[r]["tokens"]) > requests[r]["computed"]]
    if order:
        q_lens = np.array([len(requests[r]["tokens"]) - requests[r]["computed"] for r in order],
                          dtype=np.int64)
        for x, y in zip(gathered(on_device, order, q_lens, sampled),
                        gathered(fresh, order, q_lens, None), strict=True):
            assert np.array_equal(x, y)


def gathered(batch: InputBatch, order: list[str], q_lens: np.ndarray,
             sampled: list[int] | None):
    runner = SimpleNamespace(batch=batch, block_size=BLOCK, device=torch.device("cpu"),
                             model=SimpleNamespace(),
                             _sampled=None if sampled is None else SampledTokens(
                                 torch.tensor(sampled, dtype=torch.long)))
    ids, positions, step = ModelRunner._prepare_inputs(runner, batch.rows_of(order), q_lens)
    return (ids.numpy(), positions.numpy(), step.block_table, step.slot_mapping.numpy(),
            step.seq_lens)


def echo(batch: InputBatch, pending: dict[str, tuple[int, int]]) -> None:
    for req_id, (offset, token) in pending.items():
        batch.write_tokens(batch.rows[req_id], offset, [token])
    pending.clear()


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_ops, max_size=40), seed=st.integers(0, 2**16))
def test_row_updates_match_a_batch_rebuilt_each_step(ops, seed):
    rng = np.random.default_rng(seed)
    batch = InputBatch(MAX_MODEL_LEN, BLOCK, max_num_reqs=1)  # grows
    requests: dict[str, dict] = {}
    next_id, next_block = 0, 0
    sampled: list[int] | None = None  # the pending rows' ids
    pending: dict[str, tuple[int, int]] = {}  # request -> (position, token) the scheduler lacks

    def blocks_for(num_tokens: int, have: list[int]) -> list[int]:
        nonlocal next_block
        new = list(range(next_block, next_block + max(0, -(-num_tokens // BLOCK) - len(have))))
        next_block += len(new)
        return new

    for op in ops:
        kind = op[0]
        if kind == "add":
            prompt = op[1]
            tokens = rng.integers(0, 100, prompt).tolist()
            r = dict(tokens=tokens, prompt=prompt, params=PARAMS[op[2]],
                     blocks=blocks_for(prompt, []), computed=0)
            requests[str(next_id)] = r
            batch.add(new_data(str(next_id), r))
            next_id += 1
        elif kind in ("finish", "preempt") and requests:
            req_id = sorted(requests)[op[1] % len(requests)]
            batch.remove(req_id)
            pending.pop(req_id, None)
            if kind == "finish":
                del requests[req_id]
            else:
                r = requests[req_id]
                r["computed"], r["blocks"] = 0, blocks_for(len(r["tokens"]), [])
                batch.add(new_data(req_id, r))
        elif kind == "decode":
            if op[1] == 2 and sampled is not None:
                batch.resolve_pending(sampled)
                sampled = None
            elif op[1] != 2:  # the scheduler has a pending token before any later one
                echo(batch, pending)
            step: list[tuple[str, int]] = []
            for req_id, r in requests.items():
                if len(r["tokens"]) >= MAX_MODEL_LEN:
                    continue
                token = int(rng.integers(0, 100))
                offset = len(r["tokens"])
                r["tokens"].append(token)
                new_blocks = blocks_for(len(r["tokens"]), r["blocks"])
                r["blocks"] += new_blocks
                r["computed"] = len(r["tokens"]) - 1
                row = batch.rows[req_id]
                if op[1] == 1:  # its value on the host before the scheduler's copy
                    batch.append_pending(batch.rows_of([req_id]))
                    batch.resolve_pending([token])
                if op[1] == 2:
                    step.append((req_id, token))
                    pending[req_id] = (offset, token)
                else:
                    batch.write_tokens(row, offset, [token])  # the scheduler's copy
                batch.append_blocks(row, new_blocks)
                batch.num_computed_tokens[row] = r["computed"]
            if step:
                batch.append_pending(batch.rows_of([req_id for req_id, _ in step]))
                sampled = [token for _, token in step]
        elif kind == "echo":
            echo(batch, pending)
        elif kind == "chunk":
            for req_id, r in requests.items():
                r["computed"] = min(len(r["tokens"]) - 1, r["computed"] + op[1])
                batch.num_computed_tokens[batch.rows[req_id]] = r["computed"]
        assert_same(batch, rebuilt(requests), requests, sampled)

"""What the model runner hands the sampler each step: neutral sampling fields cost nothing
(greedy keeps its argmax path, unused filters have no column, no penalty inputs), seeded rows
get their uniform from (seed, output position), and penalty counts follow the request across
steps and preemption."""

from __future__ import annotations

import torch

from parashift.executor.input_batch import InputBatch
from parashift.executor.sampling_inputs import sampling_metadata
from parashift.layers.sampler import position_seed, seeded_uniform
from parashift.types.outputs import NewRequestData
from parashift.types.sampling_params import SamplingParams

VOCAB = 100
CPU = torch.device("cpu")
NEUTRAL = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}


def state(params: SamplingParams, prompt: int = 4, outputs: int = 0) -> NewRequestData:
    tokens = list(range(10, 10 + prompt + outputs))
    return NewRequestData(f"r{next(_ids)}", tokens, prompt, params, [0], len(tokens))


_ids = iter(range(10**9))


def metadata(requests: list[NewRequestData]):
    """The metadata of a batch holding `requests`, all sampling."""
    batch = InputBatch(max_model_len=32, block_size=16)
    for new in requests:
        batch.add(new)
    return sampling_metadata(batch, batch.rows_of([r.req_id for r in requests]), VOCAB, CPU)


def test_greedy_with_neutral_fields_keeps_the_argmax_path():
    md = metadata([state(SamplingParams(temperature=0.0, **NEUTRAL)),
                            state(SamplingParams(temperature=0.7, top_k=1))])
    assert md.all_greedy and md.uniforms is None and md.penalties is None
    assert md.top_k is None and md.top_p is None and md.min_p is None


def test_neutral_fields_of_sampled_rows_have_no_column():
    md = metadata([state(SamplingParams(temperature=1.0, **NEUTRAL)),
                            state(SamplingParams(temperature=0.8, top_k=VOCAB))])
    assert not md.all_greedy and md.penalties is None
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.temperature.tolist() == [1.0, 0.800000011920929]


def test_filters_exist_only_for_sampled_rows_that_use_them():
    md = metadata([state(SamplingParams(temperature=0.0, top_p=0.5)),
                            state(SamplingParams(temperature=0.9, min_p=0.1))])
    assert md.top_p is None  # only the greedy row names one
    assert md.min_p.tolist() == [0.0, 0.10000000149011612]
    assert md.temperature.tolist()[0] == 0.0


def test_seeded_rows_take_their_uniform_from_seed_and_output_position():
    seeded = state(SamplingParams(temperature=1.0, seed=9), outputs=3)
    md = metadata([state(SamplingParams(temperature=1.0)), seeded])
    assert md.uniforms[1].item() == seeded_uniform(position_seed(9, 3))


def test_penalty_counts_follow_the_request():
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    batch = InputBatch(max_model_len=32, block_size=16)
    batch.add(NewRequestData("r", [10, 11, 12, 13], 2, params, [0], 4))  # outputs 12, 13
    rows = batch.rows_of(["r"])
    batch.append_pending(rows)  # sampled by the runner, then sent back by the scheduler
    batch.resolve_pending([13])
    batch.write_tokens(0, 4, [13, 13])
    # After a preemption the runner rebuilds the request from all its tokens.
    rebuilt = InputBatch(max_model_len=32, block_size=16)
    rebuilt.add(NewRequestData("r", [10, 11, 12, 13, 13, 13], 2, params, [0], 6))
    for b in (batch, rebuilt):
        md = sampling_metadata(b, rows, VOCAB, CPU)
        pairs = dict(zip(md.penalties.token_ids.tolist(), md.penalties.output_counts.tolist(),
                         strict=True))
        assert pairs == {10: 0.0, 11: 0.0, 12: 1.0, 13: 3.0}


def test_the_runner_reuses_the_columns_until_a_request_comes_or_goes():
    from types import SimpleNamespace

    from parashift.executor.model_runner import ModelRunner

    batch = InputBatch(max_model_len=32, block_size=16)
    runner = SimpleNamespace(batch=batch, _sampling_cache=None, vocab_size=VOCAB, device=CPU)
    batch.add(state(SamplingParams(temperature=0.0)))
    seeded = state(SamplingParams(temperature=1.0, seed=9, frequency_penalty=0.5), outputs=1)
    batch.add(seeded)
    rows = batch.rows_of(batch.req_ids)
    first = ModelRunner._sampling_metadata(runner, rows)
    batch.append_pending(rows)  # one step later: new positions, new counts
    batch.resolve_pending([3, 3])
    second = ModelRunner._sampling_metadata(runner, rows)
    assert second.temperature is first.temperature  # the cached column
    assert second.uniforms[1].item() == seeded_uniform(position_seed(9, 2))
    assert first.uniforms[1].item() == seeded_uniform(position_seed(9, 1))
    assert 3 in second.penalties.token_ids.tolist()
    batch.remove(batch.req_ids[0])
    third = ModelRunner._sampling_metadata(runner, batch.rows_of(batch.req_ids))
    assert third.temperature is not first.temperature and len(third.temperature) == 1

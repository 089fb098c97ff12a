"""The offline engine's input validation (test_engine.py's engine and helpers): bad sampling
params, prompts and model folders are refused with a ValueError naming the problem, and a
refused batch or token id leaves nothing queued."""

from __future__ import annotations

import json

import pytest

from parashift import LLM, SamplingParams
from parashift.models.registry import supported_architectures

from .test_engine import (  # noqa: F401 (_check_no_leaks: the autouse check after each test)
    MAX_MODEL_LEN,
    _check_no_leaks,
    greedy,
)


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n must"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": [""]}, "stop"),
])
def test_bad_sampling_params_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_mutated_after_construction_rejected_by_generate(llm):
    params = SamplingParams()
    params.temperature = -1.0
    with pytest.raises(ValueError, match="temperature"):
        llm.generate([[1, 2, 3]], params, use_tqdm=False)


def test_bad_prompts_rejected(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * MAX_MODEL_LEN], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 100_000]], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate([[1], [2]], [greedy(1)], use_tqdm=False)
    # The longest allowed prompt leaves room for one token.
    (out,) = llm.generate([[1] * (MAX_MODEL_LEN - 1)], greedy(5), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1


def test_rejected_batch_leaves_nothing_queued(llm):
    try:
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate([[1, 2, 3], [1] * MAX_MODEL_LEN], greedy(4), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert llm.output_processor.parent_of == {}
    finally:  # keep the shared engine clean for the other tests
        llm.engine.abort_requests(list(llm.engine.scheduler.requests))
        llm.output_processor.parent_of.clear()
        llm.output_processor.requests.clear()


def test_unknown_model_path_rejected(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 1, "n_head": 2,
        "n_embd": 8, "vocab_size": 16,
    }))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        LLM(str(tmp_path))
    supported = supported_architectures()
    assert supported and all(name in str(info.value) for name in supported)


def test_the_engine_refuses_a_token_id_past_its_embedding(llm):
    """What an API server lets through (a tokenizer larger than the model) fails alone in the
    engine instead of crashing its step."""
    from parashift.engine.request import Request

    vocab = llm.engine.config.model.vocab_size
    with pytest.raises(ValueError, match=f"token id {vocab} is outside"):
        llm.engine.add_request(Request("bad", [1, vocab], greedy(1), None))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        llm.engine.add_request(Request("bad", [-1], greedy(1), None))
    assert not llm.engine.has_unfinished_requests()

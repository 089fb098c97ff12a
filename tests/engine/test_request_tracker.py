"""RequestTracker, the one bookkeeping of the offline LLM and the API server: sample ids of the
n-sample fan-out, tokens, logprobs, stop strings and the EOS choice."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import make_tokenizer  # tests/conftest.py

from parashift.engine.request_tracker import RequestTracker, choose_eos_token_id
from parashift.types.outputs import EngineCoreOutput, TokenLogprobs
from parashift.types.sampling_params import SamplingParams

TOKENIZER = make_tokenizer()


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_n_samples_fan_out_with_their_own_ids_and_seeds():
    tracker = RequestTracker(TOKENIZER)
    one = tracker.add_prompt("a", 0, ids("hi"), SamplingParams())
    three = tracker.add_prompt("b", 1, ids("hi"), SamplingParams(n=3, seed=7))
    assert [sid for sid, _ in one] == ["a"]
    assert [sid for sid, _ in three] == ["b-0", "b-1", "b-2"]
    assert len({p.seed for _, p in three}) == 3  # each sample draws its own tokens
    assert [s.index for s in tracker.samples.values()] == [0, 1, 2, 3]
    assert [s.prompt_index for s in tracker.samples.values()] == [0, 1, 1, 1]
    assert tracker.num_unfinished == 4 and len(tracker.unfinished_ids()) == 4


def test_tokens_logprobs_and_finish_are_kept_per_sample():
    tracker = RequestTracker(TOKENIZER)
    tracker.add_prompt("r", 0, ids("x"), SamplingParams(logprobs=1))
    lp = TokenLogprobs([5, 6], [-0.5, -1.0], 1)
    delta = tracker.apply(EngineCoreOutput("r", ids("o"), lp))
    assert delta.text == "o" and delta.num_new_logprobs == 1 and not delta.finished
    delta = tracker.apply(EngineCoreOutput("r", ids("k"), lp, finish_reason="length"))
    sample = delta.sample
    assert delta.finished and sample.finish_reason == "length" and sample.text == "ok"
    assert sample.cumulative_logprob == -1.0 and len(sample.logprobs) == 2
    assert tracker.num_unfinished == 0
    assert tracker.apply(EngineCoreOutput("r", [], finish_reason="abort")) is None


def test_a_stop_string_finishes_the_sample_and_asks_for_an_abort():
    tracker = RequestTracker(TOKENIZER)
    tracker.add_prompt("r", 0, ids("x"), SamplingParams(stop=["END"]))
    delta = tracker.apply(EngineCoreOutput("r", ids("abcEND")))
    assert delta.finished and delta.abort
    assert delta.sample.text == "abc" and delta.sample.stop_reason == "END"
    assert tracker.apply(EngineCoreOutput("r", ids("more"))) is None  # its abort is on its way


def test_eos_comes_from_the_model_then_the_tokenizer():
    assert choose_eos_token_id(SimpleNamespace(eos_token_id=[7, 8])) == 7
    assert choose_eos_token_id(SimpleNamespace(eos_token_id=3), TOKENIZER) == 3
    assert choose_eos_token_id(SimpleNamespace(), TOKENIZER) == TOKENIZER.eos_token_id

"""The package's server (conftest.py) against the offline `LLM` on the same weights: greedy and
seeded sampled completions (every sampling mode) give the same text and logprobs, and a stop
string cuts at the same place. test_async_serving.py runs the first two against its server."""

from __future__ import annotations

import pytest
import torch

from parashift import LLM, SamplingParams

from ..servers import LONG_MAX_MODEL_LEN
from .conftest import assert_usage, complete


@pytest.fixture(scope="module")
def offline_llm(tiny_llama_long):
    threads = torch.get_num_threads()
    try:  # one thread, like the server's engine (OMP_NUM_THREADS=1)
        yield LLM(tiny_llama_long, dtype="float32", max_model_len=LONG_MAX_MODEL_LEN,
                  kv_cache_memory=32 << 20, num_threads=1)
    finally:
        torch.set_num_threads(threads)


def test_greedy_matches_offline_llm(client, offline_llm, tiny_tokenizer):
    prompts = [tiny_tokenizer.encode("hello world"), [5, 17, 42, 99, 3],
               list(range(10, 50)), [300, 12, 260]]
    max_tokens = 24
    http = [complete(client, ids, max_tokens, logprobs=0).choices[0] for ids in prompts]
    offline = offline_llm.generate(prompts, SamplingParams(temperature=0.0,
                                                           max_tokens=max_tokens,
                                                           ignore_eos=True, logprobs=0),
                                   use_tqdm=False)
    for ids, served, out in zip(prompts, http, offline, strict=True):
        ref = out.outputs[0]
        assert served.text == ref.text, ids
        assert served.finish_reason == ref.finish_reason == "length"
        assert len(ref.token_ids) == len(served.logprobs.token_logprobs) == max_tokens
        ref_logprobs = [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]
        assert served.logprobs.token_logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        assert served.logprobs.tokens == [tiny_tokenizer.decode([t]) for t in ref.token_ids]


SAMPLED = {
    "temperature": {"temperature": 1.0},
    "top-p": {"temperature": 0.8, "top_p": 0.9},
    "top-k": {"temperature": 0.8, "top_k": 20},
    "min-p": {"temperature": 0.9, "min_p": 0.05},
    "penalties": {"temperature": 0.7, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                  "frequency_penalty": 0.2},
}


@pytest.mark.parametrize("mode", SAMPLED)
def test_sampled_completion_matches_offline_llm(client, offline_llm, tiny_tokenizer, mode):
    """A seeded sampled request draws the offline engine's tokens; its logprobs are of the raw
    distribution, as offline; usage counts them."""
    fields = SAMPLED[mode]
    ids, max_tokens = [5, 17, 42, 99, 3], 20
    extra = {k: v for k, v in fields.items() if k in ("top_k", "min_p", "repetition_penalty")}
    openai_fields = {k: v for k, v in fields.items() if k not in extra}
    served = complete(client, ids, max_tokens, seed=11, logprobs=2, extra_body=extra,
                      **openai_fields)
    ref = offline_llm.generate([ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                     seed=11, logprobs=2, **fields),
                               use_tqdm=False)[0].outputs[0]
    choice = served.choices[0]
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert_usage(served.usage, len(ids), max_tokens)
    ref_logprobs = [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids, strict=True)]
    assert choice.logprobs.token_logprobs == pytest.approx(ref_logprobs, abs=1e-4)
    assert choice.logprobs.tokens == [tiny_tokenizer.decode([t]) for t in ref.token_ids]
    greedy = complete(client, ids, max_tokens).choices[0].text
    assert choice.text != greedy, "the sampled request ran greedy"


def test_stop_string_matches_offline_llm(client, offline_llm, tiny_tokenizer, stop_case):
    prompt, _, stop, expected = stop_case
    ids = tiny_tokenizer.encode(prompt)
    served = complete(client, ids, 40, stop=stop)
    ref = offline_llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=40,
                                                     ignore_eos=True, stop=stop),
                               use_tqdm=False)[0].outputs[0]
    assert served.choices[0].text == ref.text == expected
    assert served.choices[0].finish_reason == ref.finish_reason == "stop"
    assert served.usage.completion_tokens == len(ref.token_ids)

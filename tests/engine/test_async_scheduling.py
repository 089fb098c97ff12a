"""Async scheduling (engine/core.py: step N+1 scheduled while step N runs, with placeholders
for N's tokens) gives the tokens that one step at a time gives: greedy and seeded sampling,
n=3, stop strings, logprobs, preemption under a small KV cache, aborts mid-stream, a
structured-output constraint (its mask made once the token in flight is in), and tensor and
pipeline parallel with all of these (tp rank 0 broadcasts its sampled ids, and samples a
deferred mask's step at SampleTokens; a pipeline keeps its own batches in flight). Lockstep
waves (dp2xep) are in serve/test_expert_parallel_waves.py, a served engine in
serve/test_async_serving.py."""

from __future__ import annotations

import pytest
import torch

from parashift import LLM, SamplingParams, StructuredOutputsParams
from parashift.engine.request import Request

from .test_engine import assert_no_leaks

PROMPTS = [[5, 17, 99, 3], list(range(40, 90)), [200, 7] * 6, list(range(40, 90)) + [1, 2],
           list(range(100, 140))]
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7, n=3, max_tokens=12,
                         logprobs=2, frequency_penalty=0.3)


def make(model: str, async_scheduling: bool, **flags) -> LLM:
    return LLM(model, dtype="float32", max_model_len=256, max_num_batched_tokens=32,
               kv_cache_memory=flags.pop("kv_cache_memory", 8 << 20),
               async_scheduling=async_scheduling, **flags)


def outputs(llm: LLM, params: SamplingParams) -> list[list[tuple]]:
    return [[(c.token_ids, c.text, c.finish_reason,
              [{t: round(x, 4) for t, x in lp.items()} for lp in c.logprobs or []])
             for c in o.outputs] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


PREEMPTIONS: list[int] = []  # of the last `both`, per mode


def both(model: str, params: list[SamplingParams], **flags):
    """Each params' outputs, one step at a time and async."""
    results = []
    PREEMPTIONS.clear()
    for mode in (False, True):
        llm = make(model, mode, **flags)
        try:
            # a pipeline keeps its own batches in flight, without placeholders
            assert llm.engine.async_scheduling == (mode and "pp" not in flags.get("strategy", ""))
            results.append([outputs(llm, p) for p in params])
            assert_no_leaks(llm)
            PREEMPTIONS.append(llm.engine.stats().num_preemptions)
        finally:
            llm.shutdown()
    return results


def test_greedy_seeded_n3_stop_strings_and_logprobs_match(tiny_llama):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    sync, async_ = both(tiny_llama, [greedy, SAMPLED,
                                     SamplingParams(temperature=0, max_tokens=30, stop=["a"])])
    assert sync == async_
    assert any(c[2] == "stop" for o in sync[2] for c in o), "no stop string ever matched"


def test_preemption_and_recompute_match(tiny_llama):
    # 16 blocks of 16 tokens for five requests of up to 98 tokens: preemption is certain.
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=48, ignore_eos=True)
    sync, async_ = both(tiny_llama, [params], num_gpu_blocks_override=16)
    assert sync == async_
    assert all(PREEMPTIONS), PREEMPTIONS


CONSTRAINED = SamplingParams(temperature=1.0, seed=11, max_tokens=40, structured_outputs=(
    StructuredOutputsParams(regex=r"(ab|cd){2,6}x")))


def test_a_constraint_masks_after_the_token_in_flight(tiny_llama):
    sync, async_ = both(tiny_llama, [CONSTRAINED])
    assert sync == async_
    assert all(c[2] == "stop" for o in sync[0] for c in o)


def test_an_aborted_request_emits_nothing_more(tiny_llama):
    """Abort one request after its third token: it emits nothing after, the others' tokens
    are those of one step at a time, and nothing leaks."""
    results = []
    for mode in (False, True):
        llm = make(tiny_llama, mode)
        core = llm.engine
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            core.add_request(Request(str(i), prompt, params, None))
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        while core.has_unfinished_requests():
            for out in core.step():
                assert out.request_id != "1" or len(tokens["1"]) < 3, "a token after abort"
                tokens[out.request_id] += out.new_token_ids
            if len(tokens["1"]) == 3 and "1" in core.scheduler.requests:
                core.abort_requests(["1"])
        assert_no_leaks(llm)
        results.append(tokens)
        llm.shutdown()
    assert results[0] == results[1] and len(results[0]["1"]) == 3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tp2", "pp2"])
def test_tensor_and_pipeline_parallel_match(tiny_model_factory, strategy):
    folder = tiny_model_factory("llama", num_hidden_layers=4)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sync, async_ = both(folder, [greedy, SAMPLED, CONSTRAINED], strategy=strategy)
    assert sync == async_
    assert all(c[2] == "stop" for o in sync[2] for c in o)  # every constrained output ended


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_on_cuda_placeholders_come_from_the_device(tiny_llama, enforce_eager):
    """The sampled ids stay on the GPU for the next step's placeholders and reach the host
    through pinned memory: the same tokens as one step at a time, eager and in CUDA graphs."""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    sync, async_ = both(tiny_llama, [greedy, SAMPLED, CONSTRAINED], device="cuda",
                        attention_backend="triton", enforce_eager=enforce_eager)
    assert sync == async_

"""--deterministic (docs/reproducibility.md): a request's tokens and logprobs are bitwise the
same alone and inside any batch of other requests, prefilled whole or in chunks of any size,
after a prefix-cache hit (local, or loaded back from the host KV tier), after preemption and
recompute, with tp2 or pp2 and async scheduling on or off; greedy and seeded sampling at
temperature 1 with top-p, in float32 and bfloat16, on a tiny model and SmolLM2. Hypothesis
draws the batches; the reference is the request alone on a fresh engine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parashift import LLM, SamplingParams

from .test_engine import assert_no_leaks

TARGET = [(7 * i) % 250 + 1 for i in range(37)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True,
                        logprobs=5)
SEEDED_N3 = SamplingParams(temperature=1.0, top_p=0.9, seed=5, n=3, max_tokens=8,
                           ignore_eos=True, logprobs=5)
CHUNKS = (5, 16, 64)  # --max-num-batched-tokens: the target's prefill in 8, 3 or 1 pieces


def engine(model: str, dtype: str, **flags) -> LLM:
    return LLM(model, dtype=dtype, max_model_len=256, deterministic=True,
               kv_cache_memory=flags.pop("kv_cache_memory", 16 << 20), **flags)


def answer(outputs) -> list[tuple]:
    """Each choice's tokens and logprobs, the floats as they are (compared bit for bit)."""
    return [(c.token_ids, [dict(lp) for lp in c.logprobs]) for c in outputs.outputs]


@pytest.fixture(scope="module", params=[("tiny_llama", "float32"), ("tiny_llama", "bfloat16"),
                                        ("smollm2_path", "bfloat16")], ids=lambda p: p[1] if
                p[0] == "tiny_llama" else "smollm2")
def engines(request):
    """The reference (the target alone on a fresh engine), then engines that prefill in
    chunks of each size, and one whose small KV cache preempts."""
    model, dtype = request.getfixturevalue(request.param[0]), request.param[1]
    made = {"alone": engine(model, dtype)}
    try:
        reference = {name: answer(made["alone"].generate([TARGET], params, use_tqdm=False)[0])
                     for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}
        for chunk in CHUNKS:
            made[chunk] = engine(model, dtype, max_num_batched_tokens=chunk)
        # 20 blocks of 16 tokens: the crowd below cannot all stay
        made["preempting"] = engine(model, dtype, max_num_batched_tokens=64,
                                    kv_cache_memory=20 * made["alone"].engine.executor
                                    .kv_block_bytes())
        yield made, reference
        for llm in made.values():
            assert_no_leaks(llm)
    finally:
        for llm in made.values():
            llm.shutdown()


OTHERS = st.lists(st.lists(st.integers(1, 250), min_size=1, max_size=60), max_size=63)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow, HealthCheck.data_too_large])
@given(others=OTHERS, where=st.integers(0, 63), on=st.sampled_from(["alone", *CHUNKS]),
       sampled=st.booleans(), other_max_tokens=st.integers(1, 12))
def test_a_request_is_bitwise_the_same_in_any_batch(engines, others, where, on, sampled,
                                                    other_max_tokens):
    made, reference = engines
    params = SEEDED if sampled else GREEDY
    where = min(where, len(others))
    prompts = [*others[:where], TARGET, *others[where:]]
    other = SamplingParams(temperature=0.8, max_tokens=other_max_tokens, ignore_eos=True)
    outputs = made[on].generate(prompts, [*[other] * where, params,
                                          *[other] * (len(others) - where)], use_tqdm=False)
    assert answer(outputs[where]) == reference["seeded" if sampled else "greedy"]


def test_after_a_prefix_cache_hit_and_under_preemption(engines):
    made, reference = engines
    alone = made["alone"]
    hits = alone.engine.stats().prefix_cache_hit_tokens
    assert answer(alone.generate([TARGET], GREEDY, use_tqdm=False)[0]) == reference["greedy"]
    assert alone.engine.stats().prefix_cache_hit_tokens > hits  # served from the cache
    # A prompt that shares the target's first 32 tokens, then the target: a partial hit.
    cousin = TARGET[:32] + [3, 3, 3]
    outputs = made[16].generate([cousin, TARGET], GREEDY, use_tqdm=False)
    assert answer(outputs[1]) == reference["greedy"]
    preempting = made["preempting"]
    crowd = [[(11 * i + j) % 250 + 1 for j in range(40)] for i in range(8)]  # 5 blocks each
    for params, name in ((GREEDY, "greedy"), (SEEDED, "seeded")):
        outputs = preempting.generate([*crowd, TARGET], [
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 8 + [params],
            use_tqdm=False)
        assert answer(outputs[-1]) == reference[name]
    assert preempting.engine.stats().num_preemptions > 0


def test_the_paths_it_runs(engines):
    """Every linear on a path whose rows do not depend on the row count; the attention
    backend sends prefill tokens through the decode kernel."""
    made, _ = engines
    model = made["alone"].engine.executor.worker.model
    paths = {m.gemm.kind for m in model.modules() if hasattr(m, "gemm")}
    dtype = next(p.dtype for p in model.parameters() if not p.is_meta)
    assert paths == ({"own-bf16"} if dtype == torch.bfloat16 else {"rows"}), paths
    assert made["alone"].engine.executor.worker.backend.deterministic


def test_a_prefix_loaded_back_from_the_host_tier(tiny_llama):
    """The target computed cold, its blocks evicted from a pool of 12 by other prompts, then
    its prefix loaded back from the host KV tier: the same bits, greedy and seeded."""
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128, deterministic=True,
              kv_cache_memory=12 * 8192, kv_offloading_size=1 << 20)  # 8 KiB blocks
    try:
        cold = {name: answer(llm.generate([TARGET], params, use_tqdm=False)[0])
                for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}
        for params, name in ((GREEDY, "greedy"), (SEEDED, "seeded")):
            for i in range(2):  # 2 x 7 blocks: the target's are evicted from the pool
                llm.generate([[(17 * i + j) % 250 + 1 for j in range(100)]],
                             SamplingParams(max_tokens=4), use_tqdm=False)
            loads = llm.engine.connector.stats.host_hit_blocks
            assert answer(llm.generate([TARGET], params, use_tqdm=False)[0]) == cold[name]
            assert llm.engine.connector.stats.host_hit_blocks > loads  # from the tier
        while llm.engine.has_work():  # the last stores, settled as the engine loop would
            llm.engine.step()
        assert_no_leaks(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("strategy", ["tp2", "pp2"])
def test_with_tensor_or_pipeline_parallel_and_async_scheduling(tiny_llama, strategy):
    """Across runs of one layout: the target alone, then inside a crowd, with async scheduling
    off and on (a pipeline keeps its own batches in flight instead), in bfloat16; greedy and
    seeded n=3."""
    crowd = [[(13 * i + j) % 250 + 1 for j in range(5 + 7 * i)] for i in range(9)]
    seen = []
    for async_scheduling in (False, True):
        llm = engine(tiny_llama, "bfloat16", strategy=strategy, max_num_batched_tokens=16,
                     async_scheduling=async_scheduling)
        try:
            for params in (GREEDY, SEEDED_N3):
                alone = answer(llm.generate([TARGET], params, use_tqdm=False)[0])
                inside = llm.generate([*crowd[:4], TARGET, *crowd[4:]], params, use_tqdm=False)
                assert answer(inside[4]) == alone
                seen.append(alone)
            assert_no_leaks(llm)
        finally:
            llm.shutdown()
    assert seen[:2] == seen[2:]


@pytest.mark.parametrize(("flags", "named"), [
    ({"device": "cuda"}, "runs on CPU for now"),
    ({"cpu_kernels": "off"}, "--cpu-kernels not off"),
    ({"attention_backend": "torch"}, "--attention-backend cpu"),
    ({"quantization": "int8"}, "--quantization int8"),
    ({"strategy": "tp4", "disable_shm_all_reduce": True}, "shared-memory all-reduce"),
    ({"model": "mixtral"}, "mixture-of-experts"),
])
def test_what_it_refuses_names_why(tiny_model_factory, flags, named):
    from parashift.engine.args import EngineArgs, create_config

    model = tiny_model_factory(flags.pop("model", "llama"), num_attention_heads=4,
                               num_key_value_heads=4)
    with pytest.raises(ValueError, match=named):
        create_config(EngineArgs(model=model, deterministic=True, **flags))

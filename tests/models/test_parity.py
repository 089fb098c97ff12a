"""parashift vs transformers in float32: per-step log-probabilities within tolerance and
identical greedy tokens, for a batch of mixed-length prompts run together."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from parashift import LLM, SamplingParams

LOGPROB_ATOL = 2e-4
NUM_TOP = 5


def reference_greedy(folder: str, prompts: list[list[int]], max_tokens: int):
    """Greedy tokens and per-step log-softmax from transformers, one prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            tokens, logprobs = [], []
            for _ in range(max_tokens):
                logp = model(ids).logits[0, -1].float().log_softmax(-1)
                token = int(logp.argmax())
                tokens.append(token)
                logprobs.append(logp)
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            results.append((tokens, logprobs))
    return results


def assert_matches_reference(llm: LLM, folder: str, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=NUM_TOP)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    reference = reference_greedy(folder, prompts, max_tokens)
    for out, (ref_tokens, ref_logprobs) in zip(outputs, reference, strict=True):
        completion = out.outputs[0]
        assert completion.token_ids == ref_tokens
        for step, (ours, ref) in enumerate(zip(completion.logprobs, ref_logprobs, strict=True)):
            for token_id, logprob in ours.items():
                assert abs(logprob - float(ref[token_id])) < LOGPROB_ATOL, (step, token_id)


def mixed_prompts(vocab: int, lengths=(3, 17, 40, 70, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize(
    "arch,tie",
    [("llama", False), ("llama", True), ("llama3", False), ("mistral", False),
     ("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True)],
)
def test_tiny_model_matches_transformers(tiny_model_factory, arch, tie):
    folder = tiny_model_factory(arch, tie)
    # A small token budget forces chunked prefill and mixed prefill/decode steps.
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=64, kv_cache_memory=8 << 20)
    assert_matches_reference(llm, folder, mixed_prompts(256), max_tokens=12)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_path):
    llm = LLM(smollm2_path, dtype="float32", max_model_len=512)
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):",
             "Once upon a time, in a small village by the sea, there lived an old fisherman who",
             "1, 2, 3, 4,"]
    prompts = [tok.encode(t) for t in texts]
    assert_matches_reference(llm, smollm2_path, prompts, max_tokens=8)


CUDA_PATHS = [("torch", True), ("triton", True), ("triton", False)]  # (backend, enforce_eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")
@pytest.mark.parametrize("backend,eager", CUDA_PATHS, ids=["torch", "triton", "triton-graphs"])
def test_on_cuda_every_attention_path_matches_transformers(tiny_model_factory, backend, eager):
    """The GPU paths in float32 (no TF32: torch's default for matmul, IEEE tl.dot): the torch
    backend, the Triton kernels, and the Triton kernels replayed from CUDA graphs. Decode
    batches of 1-5 requests run in graphs padded to the capture sizes 1, 2, 4 and 8."""
    folder = tiny_model_factory("llama", hidden_size=384, num_attention_heads=6,
                                num_key_value_heads=2, intermediate_size=256)
    llm = LLM(folder, device="cuda", dtype="float32", attention_backend=backend,
              enforce_eager=eager, max_num_seqs=8, max_num_batched_tokens=64,
              kv_cache_memory=16 << 20)
    assert_matches_reference(llm, folder, mixed_prompts(256), max_tokens=12)

"""Prefill alone, the same way on both engines: 40 prompts of 300 random token ids (seed 1), one
greedy output token each, prefix caching off, bf16, 5 timed reps after a warm-up; prints the
prompt tokens per second of each rep and their median.

    python scripts/prefill_vs_peer.py parashift
    (source ../shared/peers/env_vllm.sh
     /tmp/anchors/venv-vllm/bin/python scripts/prefill_vs_peer.py vllm)
"""

from __future__ import annotations

import random
import statistics
import sys
import time

MODEL = "/tmp/anchors/smollm2-135m"  # ../shared/peers/README.md's bf16 folder
PROMPTS, PROMPT_LEN, VOCAB = 40, 300, 49152


def main() -> None:
    engine = sys.argv[1]
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=MODEL, dtype="bfloat16", max_model_len=1024,
                  enable_prefix_caching=False, seed=0)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    else:
        from parashift import LLM, SamplingParams

        llm = LLM(MODEL, dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False,
                  seed=0)
        inputs = prompts
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(inputs[:8], params, use_tqdm=False)
    rates = []
    for _ in range(5):
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        rates.append(PROMPTS * PROMPT_LEN / (time.perf_counter() - start))
    print(f"{engine} prompt tok/s per rep: {' '.join(f'{r:.1f}' for r in rates)}; "
          f"median {statistics.median(rates):.1f}")


if __name__ == "__main__":  # vLLM starts its engine with spawn
    main()

"""A real model behind a real `parashift run`: SmolLM2-135M-Instruct answers a chat question,
and the served greedy answer is the offline `LLM.chat` answer, token for token."""

from __future__ import annotations

import pytest
import torch

from parashift import LLM, SamplingParams

from .servers import running_server

MAX_MODEL_LEN = 512
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 48

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_path):
    with running_server(smollm2_path, "--dtype", "float32", "--max-model-len",
                        str(MAX_MODEL_LEN), "--kv-cache-memory", "64MiB") as s:
        yield s


@pytest.fixture(scope="module")
def offline(smollm2_path):
    threads = torch.get_num_threads()
    try:  # one thread, like the server's engine (OMP_NUM_THREADS=1)
        llm = LLM(smollm2_path, dtype="float32", max_model_len=MAX_MODEL_LEN,
                  kv_cache_memory=64 << 20, num_threads=1)
        out = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0]
        return out, len(llm.apply_chat_template(MESSAGES))
    finally:
        torch.set_num_threads(threads)


def test_capital_of_france(server, offline):
    ref, num_prompt_tokens = offline
    client = server.client()
    r = client.chat.completions.create(model=server.model_name, messages=MESSAGES,
                                       max_tokens=MAX_TOKENS, temperature=0.0)
    answer = r.choices[0].message.content
    assert answer.strip() and "Paris" in answer, answer
    assert answer == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == num_prompt_tokens
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_capital_of_france_streamed(server, offline):
    ref, _ = offline
    stream = server.client().chat.completions.create(
        model=server.model_name, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0,
        stream=True)
    text, finish = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                finish.append(c.finish_reason)
    assert text == ref.outputs[0].text and "Paris" in text
    assert finish == [ref.outputs[0].finish_reason]

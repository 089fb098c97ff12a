"""One real `parashift run` (tiny random Llama, float32, a long context) for every module here,
which test its OpenAI API through the official `openai` client and plain HTTP; the helpers
they share: greedy completions and chats, a consumed stream, usage, a stop string found in a
greedy output. test_async_serving.py runs some of these tests against its own server."""

from __future__ import annotations

import pytest

from ..servers import LONG_ARGS, running_server

MODEL = "tiny-served"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
# Candidates for finding a stop string that really occurs in a greedy output.
PROMPTS = ["abc", "Once upon a time", "hello", "The quick brown fox", "1 2 3 4", "def f(x):",
           "aaaa", "Paris is", "zebra", "0123456789"]


@pytest.fixture(scope="package")  # one server for the package: its modules share it
def server(tiny_llama_long):
    with running_server(tiny_llama_long, *LONG_ARGS, "--served-model-name", MODEL,
                        model_name=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def complete(client, prompt, max_tokens=16, **kwargs):
    """A greedy completion that runs exactly max_tokens tokens (unless a stop ends it)."""
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                     temperature=kwargs.pop("temperature", 0.0),
                                     extra_body=extra, **kwargs)


def chat(client, messages=MESSAGES, max_tokens=16, **kwargs):
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                          temperature=kwargs.pop("temperature", 0.0),
                                          extra_body=extra, **kwargs)


class Collected:
    """A consumed stream: text, finish reasons, logprobs per choice index, and the usage."""

    def __init__(self, stream, chat: bool):
        self.chunks = list(stream)
        self.text: dict[int, str] = {}
        self.finish: dict[int, list[str]] = {}
        self.logprobs: dict[int, list] = {}
        self.usage = None
        for i, chunk in enumerate(self.chunks):
            if chunk.usage is not None:
                assert i == len(self.chunks) - 1, "usage must come in the last chunk"
                assert chunk.choices == []
                self.usage = chunk.usage
            for c in chunk.choices:
                piece = (c.delta.content or "") if chat else c.text
                self.text[c.index] = self.text.get(c.index, "") + piece
                if c.finish_reason is not None:
                    self.finish.setdefault(c.index, []).append(c.finish_reason)
                if c.logprobs is not None:
                    entries = c.logprobs.content if chat else c.logprobs.token_logprobs
                    self.logprobs.setdefault(c.index, []).extend(entries or [])


def assert_usage(usage, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == completion_tokens
    assert usage.total_tokens == prompt_tokens + completion_tokens


def chat_prompt_len(tokenizer, messages) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def find_stop(text: str) -> tuple[str, int] | None:
    """A printable-ASCII piece of `text` (several tokens of the byte-level tokenizer, so it
    spans token boundaries) whose first occurrence is not at the start."""
    for length in (3, 2):
        for i in range(1, len(text) - length + 1):
            piece = text[i : i + length]
            if all(32 <= ord(ch) < 127 for ch in piece) and text.find(piece) == i:
                return piece, i
    return None


@pytest.fixture(scope="module")
def stop_case(client):
    """(prompt, full greedy text, stop string, text expected with that stop)."""
    for prompt in PROMPTS:
        full = complete(client, prompt, 40).choices[0].text
        found = find_stop(full)
        if found:
            stop, i = found
            return prompt, full, stop, full[:i]
    pytest.fail("no greedy output of the tiny model has a printable piece to stop at")

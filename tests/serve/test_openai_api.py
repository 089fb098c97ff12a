"""The OpenAI API of a real `parashift run` (tiny random Llama, float32), through the official
`openai` client and plain HTTP: completions and chat, whole and streamed, n, logprobs, stop
strings, usage, prompt forms, echo, served model name, parity with the offline `LLM`,
concurrent streams, and a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time

import openai
import pytest
import torch

from parashift import LLM, SamplingParams

from .conftest import LONG_ARGS, LONG_MAX_MODEL_LEN, running_server

MODEL = "tiny-served"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
# Candidates for finding a stop string that really occurs in a greedy output.
PROMPTS = ["abc", "Once upon a time", "hello", "The quick brown fox", "1 2 3 4", "def f(x):",
           "aaaa", "Paris is", "zebra", "0123456789"]


@pytest.fixture(scope="module")
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


# --- models and names ------------------------------------------------------------------------
def test_models_lists_the_served_name(server, client, tiny_llama_long):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, body = server.get_json("/v1/models")
    assert status == 200 and body["object"] == "list"
    assert body["data"][0]["id"] == MODEL and body["data"][0]["object"] == "model"
    assert body["data"][0]["max_model_len"] == LONG_MAX_MODEL_LEN
    # Responses name the served model; the folder's own name is not served.
    assert complete(client, "hi", 2).model == MODEL
    folder_name = os.path.basename(tiny_llama_long.rstrip("/"))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=folder_name, prompt="hi", max_tokens=2)
    # "model" may be left out.
    status, raw = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and json.loads(raw)["model"] == MODEL


# --- completions -----------------------------------------------------------------------------
def test_completion_json(client, tiny_tokenizer):
    r = complete(client, "hello", 12)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert isinstance(choice.text, str)
    assert_usage(r.usage, len(tiny_tokenizer.encode("hello")), 12)


def test_completion_stream_matches_json(client, tiny_tokenizer):
    whole = complete(client, "Once upon a time", 20)
    stream = complete(client, "Once upon a time", 20, stream=True,
                      stream_options={"include_usage": True})
    got = Collected(stream, chat=False)
    assert got.text == {0: whole.choices[0].text}
    assert got.finish == {0: ["length"]}
    assert all(c.object == "text_completion" and c.model == MODEL for c in got.chunks)
    assert len({c.id for c in got.chunks}) == 1
    assert_usage(got.usage, len(tiny_tokenizer.encode("Once upon a time")), 20)


def test_stream_without_include_usage_has_no_usage(client):
    got = Collected(complete(client, "hello", 5, stream=True), chat=False)
    assert got.usage is None and got.finish == {0: ["length"]}
    assert all(c.usage is None for c in got.chunks)


def test_completion_n2(client):
    r = complete(client, "abc", 10, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text  # greedy: both samples agree
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == 3

    sampled = complete(client, "abc", 10, n=2, temperature=1.0, seed=7)
    assert [c.index for c in sampled.choices] == [0, 1]
    assert sampled.usage.completion_tokens == 20
    got = Collected(complete(client, "abc", 10, n=2, temperature=1.0, seed=7, stream=True,
                             stream_options={"include_usage": True}), chat=False)
    assert got.finish == {0: ["length"], 1: ["length"]}
    # Seeded sampling is reproducible: streamed or not, each index gets the same text.
    assert got.text == {c.index: c.text for c in sampled.choices}
    assert_usage(got.usage, 3, 20)


def test_completion_logprobs(client):
    n_top = 3
    r = complete(client, "The quick brown fox", 8, logprobs=n_top)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert len(lp.text_offset) == 8 and lp.text_offset[0] == 0
    for i in range(1, 8):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert isinstance(token, str)
        assert logprob <= 0.0
        # A dict keyed by token text: tokens that decode alike share a key, so <= n entries.
        assert isinstance(top, dict) and 1 <= len(top) <= n_top
        assert all(v <= 0.0 for v in top.values())
        # Greedy picks the argmax: nothing in the top list is more likely.
        assert logprob >= max(top.values()) - 1e-5
    # logprobs=0: the sampled token's logprob only.
    r0 = complete(client, "The quick brown fox", 8, logprobs=0)
    assert r0.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert all(top == {} for top in r0.choices[0].logprobs.top_logprobs)
    # Streamed: the same logprobs, one per token.
    got = Collected(complete(client, "The quick brown fox", 8, logprobs=n_top, stream=True),
                    chat=False)
    assert got.logprobs[0] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_completion_logprobs_streamed_text_offset(client):
    whole = complete(client, "The quick brown fox", 12, logprobs=1).choices[0].logprobs
    assert any(whole.text_offset), "pick a prompt whose tokens have text"
    got = complete(client, "The quick brown fox", 12, logprobs=1, stream=True)
    offsets = [o for chunk in got for c in chunk.choices for o in c.logprobs.text_offset]
    assert offsets == whole.text_offset


def test_completion_prompt_as_token_ids(client, tiny_tokenizer):
    ids = tiny_tokenizer.encode("hello")
    by_text = complete(client, "hello", 12)
    by_ids = complete(client, ids, 12)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert_usage(by_ids.usage, len(ids), 12)
    other = [7, 8, 9, 10, 11, 300]
    r = complete(client, other, 6)
    assert_usage(r.usage, len(other), 6)


def test_completion_prompt_as_list(client, tiny_tokenizer):
    texts = ["hello", "1 2 3 4"]
    singles = [complete(client, t, 9).choices[0].text for t in texts]
    r = complete(client, texts, 9)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == singles
    assert_usage(r.usage, sum(len(tiny_tokenizer.encode(t)) for t in texts), 18)
    # A list of token-id lists works the same.
    r_ids = complete(client, [tiny_tokenizer.encode(t) for t in texts], 9)
    assert [c.text for c in r_ids.choices] == singles
    # Streamed, each choice index carries its own prompt's text.
    got = Collected(complete(client, texts, 9, stream=True), chat=False)
    assert got.text == {0: singles[0], 1: singles[1]}
    assert got.finish == {0: ["length"], 1: ["length"]}


def test_completion_echo(client, tiny_tokenizer):
    plain = complete(client, "hello", 8).choices[0].text
    r = complete(client, "hello", 8, echo=True)
    assert r.choices[0].text == "hello" + plain
    assert r.usage.completion_tokens == 8
    ids = tiny_tokenizer.encode("hello")
    assert complete(client, ids, 8, echo=True).choices[0].text == "hello" + plain
    got = Collected(complete(client, "hello", 8, echo=True, stream=True), chat=False)
    assert got.chunks[0].choices[0].text.startswith("hello")
    assert got.text == {0: "hello" + plain}


# --- chat ------------------------------------------------------------------------------------
def test_chat_json(client, tiny_tokenizer):
    r = chat(client, max_tokens=12)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert_usage(r.usage, chat_prompt_len(tiny_tokenizer, MESSAGES), 12)


def test_chat_stream_matches_json(client, tiny_tokenizer):
    whole = chat(client, max_tokens=20)
    got = Collected(chat(client, max_tokens=20, stream=True,
                         stream_options={"include_usage": True}), chat=True)
    first = got.chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.index == 0
    assert all(c.object == "chat.completion.chunk" for c in got.chunks)
    assert got.text == {0: whole.choices[0].message.content}
    assert got.finish == {0: ["length"]}
    assert_usage(got.usage, chat_prompt_len(tiny_tokenizer, MESSAGES), 20)


def test_chat_n2(client):
    r = chat(client, max_tokens=7, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens == 14
    got = Collected(chat(client, max_tokens=7, n=2, stream=True,
                         stream_options={"include_usage": True}), chat=True)
    assert got.finish == {0: ["length"], 1: ["length"]}
    assert got.text == {0: r.choices[0].message.content, 1: r.choices[1].message.content}
    assert got.usage.completion_tokens == 14


def test_chat_logprobs(client):
    n_top = 4
    r = chat(client, max_tokens=10, logprobs=True, top_logprobs=n_top)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0.0
        assert isinstance(entry.bytes, list) and all(0 <= b < 256 for b in entry.bytes)
        assert len(entry.top_logprobs) == n_top
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(values[0], abs=1e-5)
    # Without logprobs there are none.
    assert chat(client, max_tokens=3).choices[0].logprobs is None
    # top_logprobs=0: the sampled token only.
    r0 = chat(client, max_tokens=10, logprobs=True, top_logprobs=0)
    assert all(e.top_logprobs == [] for e in r0.choices[0].logprobs.content)
    assert [e.logprob for e in r0.choices[0].logprobs.content] == pytest.approx(
        [e.logprob for e in content], abs=1e-5)
    # Streamed: the same entries, in order.
    got = Collected(chat(client, max_tokens=10, logprobs=True, top_logprobs=n_top, stream=True),
                    chat=True)
    assert [e.logprob for e in got.logprobs[0]] == pytest.approx([e.logprob for e in content],
                                                                 abs=1e-5)
    assert [e.token for e in got.logprobs[0]] == [e.token for e in content]


# --- stop strings ----------------------------------------------------------------------------
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


def test_stop_string_json(client, stop_case):
    prompt, full, stop, expected = stop_case
    r = complete(client, prompt, 40, stop=stop)
    choice = r.choices[0]
    assert choice.text == expected and stop not in choice.text
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop
    assert r.usage.completion_tokens < 40
    # Among several stop strings the one that occurs wins.
    r2 = complete(client, prompt, 40, stop=["\x7f\x7f\x7f\x7f", stop])
    assert r2.choices[0].text == expected and r2.choices[0].finish_reason == "stop"


def test_stop_string_stream_never_leaks(client, stop_case):
    prompt, full, stop, expected = stop_case
    got = Collected(complete(client, prompt, 40, stop=[stop], stream=True,
                             stream_options={"include_usage": True}), chat=False)
    assert got.text == {0: expected}
    assert got.finish == {0: ["stop"]}
    pieces = [c.choices[0].text for c in got.chunks if c.choices]
    for k in range(len(pieces)):  # no prefix of the stream ever shows the stop string
        assert stop not in "".join(pieces[: k + 1])
    assert got.usage.completion_tokens < 40
    # With n=2 both choices stop at the same place.
    got2 = Collected(complete(client, prompt, 40, stop=stop, n=2, stream=True), chat=False)
    assert got2.text == {0: expected, 1: expected}
    assert got2.finish == {0: ["stop"], 1: ["stop"]}


def test_stop_string_chat(client):
    full = chat(client, max_tokens=40).choices[0].message.content
    found = find_stop(full)
    if found is None:
        pytest.fail(f"the greedy chat answer {full!r} has no printable piece to stop at")
    stop, i = found
    r = chat(client, max_tokens=40, stop=stop)
    assert r.choices[0].message.content == full[:i]
    assert r.choices[0].finish_reason == "stop"
    got = Collected(chat(client, max_tokens=40, stop=stop, stream=True), chat=True)
    assert got.text == {0: full[:i]} and got.finish == {0: ["stop"]}


# --- parity with the offline engine ----------------------------------------------------------
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


def test_sixty_four_long_stop_strings_with_n4_over_400_tokens_finish(client):
    """The most stop work a request may ask for: each new token is matched only in the window
    it can complete (the matcher's unit test counts the characters)."""
    stops = [f"{i:02d}" + "\u2603" * 1022 for i in range(64)]  # 1,024 characters, never made
    r = complete(client, [5, 17, 42, 99], 400, n=4, stop=stops, temperature=1.0, seed=3)
    assert [c.finish_reason for c in r.choices] == ["length"] * 4
    assert r.usage.completion_tokens == 4 * 400


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


# --- concurrency -----------------------------------------------------------------------------
def test_32_concurrent_streams(server, client):
    prompts = [f"client {i:02d} asks: {'xyz'[i % 3] * (1 + i % 5)}" for i in range(32)]
    max_tokens = 16
    expected = [complete(client, p, max_tokens).choices[0].text for p in prompts]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, finish, usage = "", [], None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                if c.finish_reason:
                    finish.append(c.finish_reason)
            usage = chunk.usage or usage
        return text, finish, usage

    async def main():
        async with server.async_client() as aclient:
            return await asyncio.wait_for(
                asyncio.gather(*(one(aclient, p) for p in prompts)), timeout=120)

    results = asyncio.run(main())
    for prompt, want, (text, finish, usage) in zip(prompts, expected, results, strict=True):
        assert text == want, prompt
        assert finish == ["length"] and usage.completion_tokens == max_tokens
    assert server.metric("parashift_num_requests_running", 'engine="dp0"') == 0


# --- a client that goes away -----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["stream", "stream-unread", "json"])
def test_disconnect_frees_the_request(server, mode):
    """The client closes its connection while its request runs: after reading a few chunks,
    without reading (the server is stuck writing), or while waiting for a whole response."""
    running = ("parashift_num_requests_running", 'engine="dp0"')
    kv_usage = ("parashift_kv_cache_usage_ratio", 'engine="dp0"')
    disconnected = ("parashift_requests_total", 'status="disconnected"')
    before = server.metric(*disconnected) or 0.0
    # ~8000 tokens take the tiny model ~20 s: only an abort frees the engine sooner.
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": LONG_MAX_MODEL_LEN - 100,
                       "temperature": 0, "ignore_eos": True,
                       "stream": mode != "json"}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if mode == "stream-unread":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        if mode == "stream":
            received = b""
            while received.count(b"data: ") < 5:
                data = sock.recv(65536)
                assert data, "the server closed the stream early"
                received += data
            assert received.startswith(b"HTTP/1.1 200")
        elif mode == "stream-unread":  # tokens have come, and stay unread in the buffer
            while b"data: " not in (data := sock.recv(65536, socket.MSG_PEEK)):
                assert data, "the server closed the stream early"
                time.sleep(0.02)
            assert data.startswith(b"HTTP/1.1 200")
        # Well into generation: the request has filled its first KV block and taken another
        # (a prompt of a few tokens fills one block of 16 after some 14 generated tokens).
        deadline = time.monotonic() + 30
        while server.metric(*running) != 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        first_block = server.metric(*kv_usage)
        assert first_block > 0
        while server.metric(*kv_usage) <= first_block:
            assert time.monotonic() < deadline, "the request generates nothing"
            time.sleep(0.02)
        assert server.metric(*running) == 1
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the handler's counter may land after the engine's
        if (server.metric(*running) == 0 and server.metric(*kv_usage) == 0
                and server.metric(*disconnected) == before + 1):
            break
        time.sleep(0.05)
    assert server.metric(*running) == 0, "the request kept running after the client left"
    assert server.metric(*kv_usage) == 0, "the request's KV blocks were not freed"
    assert server.metric(*disconnected) == before + 1
    status, health = server.get_json("/health")
    assert status == 200 and health["status"] == "ok"

"""`parashift run --strategy p1xd1` (issue 57) with the real SmolLM2 under --deterministic: a
request's prompt and first token come from the prefill rank dp0, its KV goes to the decode
rank dp1 through the node's host tier, and dp1 continues. Every answer equals the one dp1
gives alone (pinned there, which hands nothing off), bit for bit: chat with logprobs, seeded
n=3, stop strings, a JSON schema and a named tool call; streamed, the same texts, logprobs
and finish reasons. A client that leaves before its first token, after it, or while the
decode rank streams leaves no KV block held on either rank; /sleep and /wake_up reach both
pools. An MoE model hands off like a dense one. What pools cannot run yet (the prefill pool
off the head node, on Ray) and an autoscaler that would shrink the decode pool away are
refused at launch."""

from __future__ import annotations

import json
import time

import pytest

from parashift.engine.args import EngineArgs
from parashift.runtime.autoscaler import AutoscaleConfig
from parashift.runtime.launcher import Launcher
from parashift.runtime.node import ServeArgs

from .servers import TINY_ARGS, holds_nothing, running_server
from .test_deterministic_serving import post

pytestmark = pytest.mark.slow

ARGS = ("--deterministic", "--dtype", "bfloat16", "--max-model-len", "512",
        "--kv-cache-memory", "64MiB", "--strategy", "p1xd1", "--no-async-scheduling",
        "--enable-admin-routes")
SYSTEM = ("You are a careful assistant. Answer in one short sentence, plainly, without "
          "lists, and never repeat the question back to the user. ")  # whole blocks to hand off
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CASES = {
    "chat": ("/v1/chat/completions", {
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "Name two colours of the rainbow."}],
        "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 3}),
    "seeded": ("/v1/completions", {
        "prompt": SYSTEM + "The three primary colours are", "max_tokens": 12,
        "temperature": 1.0, "top_p": 0.9, "seed": 5, "n": 3, "logprobs": 3}),
    "stop": ("/v1/completions", {
        "prompt": SYSTEM + "Count from one to ten in words: one, two,", "max_tokens": 40,
        "temperature": 0, "stop": [" six"]}),
    "schema": ("/v1/chat/completions", {
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "Describe a cat as JSON."}],
        "max_tokens": 60, "temperature": 0, "response_format": {
            "type": "json_schema", "json_schema": {"name": "cat", "schema": {
                "type": "object", "properties": {"name": {"type": "string"},
                                                 "age": {"type": "integer"}},
                "required": ["name", "age"]}}}}),
    "tool": ("/v1/chat/completions", {
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "What is the weather in Paris?"}],
        "max_tokens": 40, "temperature": 0, "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
}


@pytest.fixture(scope="module")
def server(smollm2_path):
    with running_server(smollm2_path, *ARGS) as s:
        yield s


def answer(reply: dict) -> list:
    """What must match: each choice's text or message, logprobs and finish reason."""
    out = []
    for c in reply["choices"]:
        message = c.get("message")
        if message is not None:
            message = {k: message.get(k) for k in ("content", "tool_calls")}
            for call in message["tool_calls"] or ():
                call.pop("id", None)  # fresh per answer
        out.append((c.get("text"), message, c.get("logprobs"), c["finish_reason"]))
    return out


def decode_loads(server) -> float:
    return server.metric("parashift_kv_tier_loads", 'engine="dp1",tier="host"') or 0.0


def wait_for(check, what: str, server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}; output:\n{server.output()[-3000:]}"
        time.sleep(0.05)


@pytest.mark.parametrize("case", list(CASES))
def test_answers_equal_the_decode_rank_alone(server, case):
    path, body = CASES[case]
    loads = decode_loads(server)
    handed = answer(post(server, path, body))  # dp0 prefills, dp1 decodes
    # dp1 took the prompt's blocks from the host tier (engines report with their outputs)
    wait_for(lambda: decode_loads(server) > loads, "dp1 loaded nothing from the tier", server)
    alone = answer(post(server, path, body, rank=1))
    assert handed == alone
    if case == "stop":
        assert handed[0][0] and " six" not in handed[0][0] and handed[0][3] == "stop"
    if case == "tool":
        (_, message, _, finish), = handed
        assert json.loads(message["tool_calls"][0]["function"]["arguments"])["city"]


def texts(reply: dict) -> list:
    """Each choice's text, token logprobs and finish reason, as a stream can rebuild them."""
    out = []
    for c in reply["choices"]:
        logprobs = c.get("logprobs") or {}
        out.append((c["text"] if "text" in c else c["message"]["content"],
                    logprobs.get("content") or logprobs.get("token_logprobs"),
                    c["finish_reason"]))
    return out


def streamed(server, path: str, body: dict) -> list:
    """`texts` of the same request streamed: its chunks put together, choice by choice."""
    status, raw = server.request("POST", path, {**body, "stream": True}, timeout=120)
    assert status == 200, raw
    choices: dict[int, tuple] = {}
    for line in raw.decode().splitlines():
        if not line.startswith("data: {"):
            continue
        for c in json.loads(line[6:])["choices"]:
            text, logprobs, finish = choices.get(c["index"], ("", None, None))
            piece = c["text"] if "text" in c else c["delta"].get("content") or ""
            more = c.get("logprobs") or {}
            more = more.get("content") or more.get("token_logprobs")
            choices[c["index"]] = (text + piece, (logprobs or []) + more if more else logprobs,
                                   c["finish_reason"] or finish)
    return [choices[i] for i in sorted(choices)]


@pytest.mark.parametrize("case", ["chat", "seeded", "stop", "schema"])
def test_a_stream_gives_the_answer(server, case):
    """Streamed, the first token from the prefill rank and the rest from the decode rank:
    the same texts, logprobs and finish reasons as the answer in one piece."""
    path, body = CASES[case]
    assert streamed(server, path, body) == texts(post(server, path, body))


def test_a_client_that_leaves_before_its_first_token_leaves_no_blocks(server):
    prompt = SYSTEM * 12  # ~450 tokens: the prefill rank is still computing when it leaves
    with pytest.raises(OSError):  # (urllib's timeout)
        server.request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 40},
                       timeout=0.05)
    holds_nothing(server, 0, 1)


def test_sleep_and_wake_reach_both_pools(server):
    path, body = CASES["chat"]
    before = answer(post(server, path, body))
    status, raw = server.request("POST", "/sleep?level=1", timeout=60)
    assert status == 200 and set(json.loads(raw)["engines"]) == {"dp0", "dp1"}, raw
    status, raw = server.request("POST", path, body)
    assert status == 503 and "asleep" in json.loads(raw)["error"]["message"], raw
    status, raw = server.request("POST", "/wake_up", timeout=60)
    assert status == 200, raw
    loads = decode_loads(server)  # the caches were emptied: dp1 loads the prompt again
    assert answer(post(server, path, body)) == before
    wait_for(lambda: decode_loads(server) > loads, "dp1 loaded nothing after the wake", server)


def test_a_client_that_leaves_mid_stream_leaves_no_blocks(server):
    client = server.client()
    stream = client.completions.create(model=server.model_name, prompt=SYSTEM + "Once upon",
                                       max_tokens=300, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # the first token, from the prefill rank
    stream.close()
    holds_nothing(server, 0, 1)


def test_a_client_that_leaves_while_the_decode_rank_streams_leaves_no_blocks(server):
    client = server.client()
    stream = client.completions.create(model=server.model_name, prompt=SYSTEM + "Long ago",
                                       max_tokens=300, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(8):  # the first from the prefill rank, the others from the decode rank
        next(chunks)
    wait_for(lambda: server.metric("parashift_num_requests_running", 'engine="dp1"') == 1.0,
             "dp1 was not decoding the stream", server)
    stream.close()
    holds_nothing(server, 0, 1)


def test_a_mixture_of_experts_model_hands_off_like_a_dense_one(mixtral):
    """p1xd1 over an MoE model (each engine holds every expert: pools do not compose with ep):
    the decode rank's answer from the handed-off KV equals its answer alone, greedy."""
    body = {"prompt": list(range(5, 69)), "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    with running_server(mixtral, *TINY_ARGS, "--strategy", "p1xd1") as moe:
        loads = decode_loads(moe)
        handed = post(moe, "/v1/completions", body)["choices"][0]["text"]
        wait_for(lambda: decode_loads(moe) > loads, "dp1 loaded nothing from the tier", moe)
        assert handed == post(moe, "/v1/completions", body, rank=1)["choices"][0]["text"]


@pytest.mark.parametrize("strategy,flags,message", [
    ("p2xd1", {"data_parallel_size_local": 1},
     r"over nodes, the prefill pool \(ranks 0-1\) runs on the head"),
    ("p1xd1", {"backend": "ray"}, "prefill/decode pools run with --backend mp"),
    ("p1xd1", {"data_parallel_size_max": 3, "autoscale": AutoscaleConfig(1, 3)},
     "keeps its 1 prefill rank"),
])
def test_what_pools_cannot_run_yet_is_refused(tiny_llama, strategy, flags, message):
    """Before anything starts: the launch checks its layout first."""
    with pytest.raises(ValueError, match=message):
        Launcher(ServeArgs(EngineArgs(model=tiny_llama, strategy=strategy), **flags))

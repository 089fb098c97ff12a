"""`parashift run --strategy dp2`: two engine processes behind one endpoint."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import time

import openai
import psutil
import pytest

from parashift import LLM, SamplingParams

from .servers import LONG_ARGS, running_server, stop

ARGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB",
        "--strategy", "dp2")
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(5 + i % 7)] for i in range(32)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, *ARGS) as s:
        yield s


def greedy_texts(model: str) -> list[str]:
    """What one offline engine (dp1) makes of PROMPTS."""
    llm = LLM(model, dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(tiny_llama):
    return greedy_texts(tiny_llama)


def ask_all(server) -> list[str]:
    """Greedy completions of PROMPTS through the openai client, 16 at a time."""
    client = server.client()

    def ask(prompt):
        reply = client.completions.create(model=server.model_name, prompt=prompt,
                                          max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"ignore_eos": True})
        return reply.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(ask, PROMPTS))


def complete(server, prompt, rank=None):
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    status, raw = server.request("POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        headers=headers)
    assert status == 200, raw
    return json.loads(raw)


def process_names(server) -> set[str]:
    names = set()
    for proc in server.current_tree():
        with contextlib.suppress(psutil.Error):
            names.add(proc.name())
    return names


def routed(server, rank):
    return server.metric("parashift_engine_requests_total", f'engine="dp{rank}"') or 0.0


def test_both_ranks_up_with_their_own_process(server):
    assert server.get_json("/health") == (200, {"status": "ok", "detail": "ok", "ranks": {
        "dp0": "serving", "dp1": "serving"}})
    pids = {server.engine_process(r).pid for r in (0, 1)}
    assert len(pids) == 2
    for rank in (0, 1):
        assert server.metric("parashift_engine_up", f'engine="dp{rank}"') == 1.0
    names = process_names(server)
    assert "parashift-dp-coo" in {n[:16] for n in names}  # the DP coordinator (comm: 15 chars)
    # The coordinator's load vector (a heartbeat at least every second) gives this API server
    # a gauge for every rank, even before any request.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
            server.metric("parashift_num_requests_running", f'engine="dp{r}"') is None
            for r in (0, 1)):
        time.sleep(0.1)
    for rank in (0, 1):
        assert server.metric("parashift_num_requests_running", f'engine="dp{rank}"') == 0.0


def test_concurrent_requests_match_dp1_and_share_the_load(server, expected):
    before = [routed(server, r) for r in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        bodies = list(pool.map(lambda p: complete(server, p), PROMPTS))
    for body, want in zip(bodies, expected, strict=True):
        assert body["choices"][0]["text"] == want
    counts = [routed(server, r) - b for r, b in zip((0, 1), before, strict=True)]
    assert sum(counts) == len(PROMPTS)
    assert max(counts) <= 2 * min(counts), counts


def test_pinning_with_the_header(server, expected):
    for rank in (0, 1):
        before = routed(server, rank)
        for prompt, want in zip(PROMPTS[:4], expected[:4], strict=True):
            assert complete(server, prompt, rank)["choices"][0]["text"] == want
        assert routed(server, rank) - before == 4


def test_killed_rank_is_reported_and_the_other_serves(tiny_llama):
    with running_server(tiny_llama, *ARGS) as s:
        victim = s.engine_process(1)
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while s.get_json("/health")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        status, body = s.get_json("/health")
        assert status == 503 and "dp1" in body["detail"]
        for prompt in PROMPTS[:6]:  # unpinned requests all go to the live rank
            complete(s, prompt)
        status, raw = s.request("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2},
                                headers={"X-data-parallel-rank": "1"})
        assert status == 503 and b"dp1" in raw


def test_shutdown_declares_no_rank_dead(tiny_llama):
    """A rank that exits seconds before its sibling is not a death: the coordinator stops
    before the engines. dp1 is frozen, so it outlives dp0 by the launcher's whole engine
    timeout (10 s), far past --heartbeat-timeout (2 s)."""
    with running_server(tiny_llama, *ARGS, "--heartbeat-timeout", "2") as s:
        complete(s, PROMPTS[0])
        os.kill(s.engine_process(1).pid, signal.SIGSTOP)  # SIGKILL still ends it
        assert stop(s) == 0
        assert "engine dp0: no heartbeat" not in s.output(), s.output()[-3000:]


def test_two_api_servers_share_the_port_and_route_outputs_back(tiny_llama, expected):
    with running_server(tiny_llama, *ARGS, "--api-server-count", "2") as s:
        names = process_names(s)
        assert {"parashift-api-0", "parashift-api-1"} <= names, names
        # Separate connections (urllib opens one per request) land on both servers.
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            bodies = list(pool.map(lambda p: complete(s, p), PROMPTS))
        for body, want in zip(bodies, expected, strict=True):
            assert body["choices"][0]["text"] == want
        ids = {b["id"].split("-")[1] for b in bodies}  # cmpl-<server index>-<uuid>
        assert ids == {"0", "1"}, ids


def test_restarted_rank_comes_back_and_serves(tiny_llama_long):
    """dp2 with --restart-dead-engines: SIGKILL of dp1 fails its stream at once, dp0 goes on
    serving, /health names dp1 until the new dp1 (a new process) joins; then it serves again."""
    with running_server(tiny_llama_long, *LONG_ARGS, "--strategy", "dp2",
                        "--restart-dead-engines") as s:
        victim = s.engine_process(1)
        client = s.client(timeout=30.0)
        stream = client.completions.create(
            model=s.model_name, prompt="hi", max_tokens=8000, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"X-data-parallel-rank": "1"})
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            for _ in chunks:
                assert time.monotonic() - killed < 15, "the stream went on after the kill"
        assert time.monotonic() - killed < 10 and "dp1" in info.value.message

        status, body = s.get_json("/health")
        if status == 503:  # unless the new dp1 was already back
            assert "dp1" in body["detail"]
        for prompt in PROMPTS[:4]:  # meanwhile, dp0 serves
            complete(s, prompt)
        deadline = time.monotonic() + 60
        while s.get_json("/health")[0] != 200:
            assert time.monotonic() < deadline, "dp1 never came back:\n" + s.output()[-3000:]
            time.sleep(0.2)
        assert s.engine_process(1).pid != victim.pid
        before = routed(s, 1)
        body = complete(s, PROMPTS[0], rank=1)
        assert body["choices"][0]["finish_reason"] == "length"
        assert routed(s, 1) - before == 1
        assert "ready again" in s.output()


@pytest.fixture(scope="module")
def dp4(tiny_llama):
    with running_server(tiny_llama, *ARGS[:-1], "dp4") as s:
        yield s


def test_dp4_matches_dp1_shares_64_concurrent_requests_and_pins(dp4, expected):
    assert len({dp4.engine_process(r).pid for r in range(4)}) == 4
    prompts, want = PROMPTS * 2, expected * 2
    before = [routed(dp4, r) for r in range(4)]
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        bodies = list(pool.map(lambda p: complete(dp4, p), prompts))
    for body, text in zip(bodies, want, strict=True):
        assert body["choices"][0]["text"] == text
    counts = [routed(dp4, r) - b for r, b in zip(range(4), before, strict=True)]
    assert sum(counts) == len(prompts)
    assert max(counts) <= 2 * min(counts), counts
    for rank in range(4):
        before = routed(dp4, rank)
        assert complete(dp4, PROMPTS[rank], rank)["choices"][0]["text"] == expected[rank]
        assert routed(dp4, rank) - before == 1


def multi_turn_chat(llm: LLM) -> tuple[list[list[list[int]]], list[list[str]], list[int]]:
    """4 conversations sharing a 96-token system prompt, 6 turns, each turn's 4 requests at
    once: each turn appends the last reply and 8 new user tokens. Returns every turn's
    prompts and reply texts, and [cached, prompt] tokens, from one engine (dp1)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    system = [(13 * j) % 240 + 5 for j in range(96)]
    history = [list(system) for _ in range(4)]
    turns, texts, counts = [], [], [0, 0]
    for turn in range(6):
        for i, conversation in enumerate(history):
            conversation.extend((11 * i + 3 * turn + j) % 240 + 5 for j in range(8))
        prompts = [list(c) for c in history]
        results = llm.generate(prompts, params, use_tqdm=False)
        for conversation, r in zip(history, results, strict=True):
            conversation.extend(r.outputs[0].token_ids)
        turns.append(prompts)
        texts.append([r.outputs[0].text for r in results])
        counts[0] += sum(r.metrics.num_cached_tokens for r in results)
        counts[1] += sum(len(p) for p in prompts)
    return turns, texts, counts


def test_prefix_routing_keeps_a_multi_turn_chat_in_the_cache(server, tiny_llama):
    """The chat above replayed on dp2, turn by turn: its prefix hit rate (from
    usage.prompt_tokens_details.cached_tokens, matched by the engines' own counters) is at
    least 0.9x dp1's, and the replies are dp1's."""
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
    turns, want, dp1 = multi_turn_chat(llm)
    llm.shutdown()

    def engine_hits() -> float:
        return sum(server.metric("parashift_prefix_cache_hit_tokens", f'engine="dp{r}"') or 0
                   for r in (0, 1))

    def ask(prompt):
        status, raw = server.request("POST", "/v1/completions", {
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        assert status == 200, raw
        return json.loads(raw)

    hits_before = engine_hits()
    dp2 = [0, 0]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for prompts, texts in zip(turns, want, strict=True):
            replies = list(pool.map(ask, prompts))
            assert [r["choices"][0]["text"] for r in replies] == texts
            dp2[0] += sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies)
            dp2[1] += sum(r["usage"]["prompt_tokens"] for r in replies)
    assert dp2[1] == dp1[1]
    assert dp2[0] == engine_hits() - hits_before
    assert dp2[0] / dp2[1] >= 0.9 * dp1[0] / dp1[1], (dp2, dp1)


def test_a_stream_reports_the_cached_tokens_in_its_usage_chunk(server):
    """The same 70-token prompt twice, unpinned: prefix routing sends the second where the
    first one's blocks are, and the final usage chunk says 64 of its tokens were cached."""
    prompt = [(17 * j) % 240 + 5 for j in range(70)]
    usages = []
    for _ in range(2):
        status, raw = server.request("POST", "/v1/completions", {
            "prompt": prompt, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}})
        assert status == 200, raw
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        usages.append(events[-1]["usage"])
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 64

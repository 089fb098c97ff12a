"""`parashift run --strategy dp2xep` and friends: MoE experts sharded over engines that run in
lockstep waves. Outputs equal one engine holding every expert, itself checked against
transformers on the same prompts; a dead or hung engine stops its whole group, which comes
back; layouts expert parallel cannot run are refused. The helpers here serve
test_expert_parallel_waves.py, which checks the waves on one dp2xep server."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from models.test_parity import assert_matches_reference

from parashift import LLM, SamplingParams

from .servers import running_server

ARGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB")
PROMPTS = [[(11 * i + j) % 250 + 1 for j in range(3 + (5 * i) % 23)] for i in range(12)]
MAX_TOKENS = 6
LOGPROB_ATOL = 2e-4


def reference(model: str) -> list[tuple[str, list[float]]]:
    """Greedy texts and token log-probabilities of PROMPTS from one engine holding every
    expert (ep1), which first must match transformers on them."""
    llm = LLM(model, dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
    try:
        assert_matches_reference(llm, model, PROMPTS, MAX_TOKENS)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                logprobs=1)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [(o.outputs[0].text, [lp[t] for lp, t in zip(o.outputs[0].logprobs,
                                                        o.outputs[0].token_ids, strict=True)])
            for o in outs]


def complete(server, prompt, rank=None, max_tokens=MAX_TOKENS, timeout=60.0):
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    status, raw = server.request("POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 1}, headers=headers, timeout=timeout)
    assert status == 200, raw
    return json.loads(raw)["choices"][0]


def assert_matches(server, expected, ranks):
    """All PROMPTS at once, pinned round-robin over `ranks`, so that steps mix every rank's
    tokens, ranks with none, and prefill with decode."""
    pins = [ranks[i % len(ranks)] for i in range(len(PROMPTS))]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        choices = list(pool.map(lambda a: complete(server, *a),
                                zip(PROMPTS, pins, strict=True)))
    for choice, (text, logprobs) in zip(choices, expected, strict=True):
        assert choice["text"] == text
        got = choice["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < LOGPROB_ATOL


def stream_in_thread(pool, server, body, rank: int) -> concurrent.futures.Future:
    """A streamed completion read in `pool`; the future gives (status, body) once it has ended,
    and its `first_event` is set once the first token event has arrived (the API server then
    counts the stream as shown: a stream the client has seen is never re-sent)."""
    first_event = threading.Event()

    def read() -> tuple[int, bytes]:
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                         {"Content-Type": "application/json", "X-data-parallel-rank": str(rank)})
            response = conn.getresponse()
            lines = []
            while line := response.readline():
                lines.append(line)
                if line.startswith(b"data: "):
                    first_event.set()
            return response.status, b"".join(lines)
        finally:
            first_event.set()  # never leave the test waiting on a stream that failed
            conn.close()

    future = pool.submit(read)
    future.first_event = first_event  # type: ignore[attr-defined]
    return future


def test_dp2xtp2xep_matches_one_engine_with_every_expert(tiny_model_factory):
    model = tiny_model_factory("qwen3_moe")  # 5 experts over 4 ranks: 2, 1, 1, 1
    with running_server(model, *ARGS, "--strategy", "dp2xtp2xep") as s:
        assert_matches(s, reference(model), [0, 1])


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_hung_engine_fails_the_groups_requests_and_the_group_comes_back(
        tiny_model_factory, how):
    """dp2xep with a long context, so that the requests are still running when dp1 dies
    (SIGKILL) or hangs (SIGSTOP: its heartbeats stop, and the launcher kills it): both ranks'
    streams, which had sent tokens, end with an error event long before their 8000 tokens
    (dp0 cannot step without dp1's experts), /health names the ranks, and the restarted group
    serves again; a request that is not streamed fails over: it waits for the group and
    starts over there. (The coordinator times out the stopped dp0 while the new one loads:
    that verdict names the old process and must not kill the new one.)"""
    model = tiny_model_factory("mixtral", max_position_embeddings=8192)
    with running_server(model, "--dtype", "float32", "--max-model-len", "8192",
                        "--kv-cache-memory", "32MiB", "--strategy", "dp2xep",
                        "--restart-dead-engines", "--heartbeat-timeout", "2") as s:
        long_prompt = [(7 * j) % 250 + 1 for j in range(16)]
        body = {"prompt": long_prompt, "max_tokens": 8000, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            streams = [stream_in_thread(pool, s, body, r % 2) for r in range(4)]
            whole = (pool.submit(s.request, "POST", "/v1/completions", {
                **body, "max_tokens": 1500}, {"X-data-parallel-rank": "1"}, 120)
                if how == signal.SIGKILL else None)
            # Every stream has had its first token out, and every request runs, before dp1 goes
            # (a stream the client has not seen yet would fail over and run to its end).
            for f in streams:
                assert f.first_event.wait(60) and not f.done(), f.result()
            want = [2, 2 if whole is None else 3]
            deadline = time.monotonic() + 60
            while [s.metric("parashift_num_requests_running", f'engine="dp{r}"')
                   for r in (0, 1)] != want:
                assert time.monotonic() < deadline and not any(f.done() for f in streams), (
                    s.output()[-4000:])
                time.sleep(0.05)
            victim = s.engine_process(1)
            os.kill(victim.pid, how)
            # Without the group stopped, dp0's streams would run their 8000 tokens to the end
            # (no error) or past the client's 60 s timeout (an exception here).
            results = [f.result() for f in streams]
        for status, raw in results:
            events = [line for line in raw.decode().splitlines() if line.startswith("data: ")]
            assert status == 200 and events[-1] == "data: [DONE]", raw[-500:]
            assert len(events) >= 3, raw[-500:]  # tokens, then the error, then [DONE]
            assert "engine dp" in json.loads(events[-2][6:])["error"]["message"]
        if how == signal.SIGSTOP:  # the API server may hear the verdict before the launcher
            deadline = time.monotonic() + 10
            while "engine dp1 is hung" not in s.output():
                assert time.monotonic() < deadline, s.output()[-4000:]
                time.sleep(0.1)
        status, body = s.get_json("/health")  # unless the group is back already
        assert status == 200 or ("dp0" in body["detail"] and "dp1" in body["detail"]), body
        assert "engine dp0 is down" in s.output() and "engine dp1 is down" in s.output()
        deadline = time.monotonic() + 90
        while s.get_json("/health")[0] != 200:
            assert time.monotonic() < deadline, s.output()[-4000:]
            time.sleep(0.2)
        assert psutil.pid_exists(victim.pid) is False or victim.status() == psutil.STATUS_ZOMBIE
        for rank in (0, 1):
            assert complete(s, PROMPTS[0], rank=rank, max_tokens=2)
        if whole is not None:
            status, raw = whole.result()
            assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 1500, raw
            assert s.metric("parashift_request_failovers_total", 'outcome="resent"') == 1


@pytest.mark.parametrize("model,args,message", [
    ("tiny_llama", ["--strategy", "dp2xep"],
     "ep: the model has no experts (expert parallel needs an MoE model)"),
    ("mixtral", ["--strategy", "dp4xtp2xep"],
     "ep: 8 dp x tp ranks need at least 8 experts, the model has 5"),
    ("mixtral", ["--strategy", "dp2xpp2xep"], "ep does not combine with pp yet"),
])
def test_layouts_expert_parallel_cannot_run_are_refused(request, model, args, message):
    folder = request.getfixturevalue(model)
    done = subprocess.run([sys.executable, "-m", "parashift.cli", "run", folder, *ARGS, *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


@pytest.mark.extended  # Ray serves dense dp2xtp2 in the suite, mp this MoE layout
def test_ray_backend_serves_an_moe_model_with_replicated_experts(mixtral):
    """Without ep an MoE model's engines are independent, as dense ones are: Ray places them
    (dp2xtp2: every expert split over each engine's two worker actors)."""
    with running_server(mixtral, *ARGS, "--backend", "ray", "--strategy", "dp2xtp2") as s:
        assert_matches(s, reference(mixtral), [0, 1])

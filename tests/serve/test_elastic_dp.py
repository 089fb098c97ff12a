"""Elastic data parallel (`--data-parallel-size-max`, POST /scale, `parashift scale`): a server
started at dp1 grows to dp3 and shrinks back under a steady stream of requests, streamed and
not, none failing and each with the tokens a fixed-size server gives; prefill/decode pools
grow and shrink their decode pool; and what a scale refuses.
(The launcher's scale state machine, case by case: test_scale.py.)"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request

import psutil
import pytest

from parashift import LLM, SamplingParams

from .servers import LONG_ARGS, LONG_MAX_MODEL_LEN, launch, live, running_server, stop, wait_serving

KEY = "elastic-admin-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
BASE = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "32MiB")
ARGS = (*BASE, "--strategy", "dp1", "--data-parallel-size-max", "3", "--admin-api-key", KEY)
PROMPTS = [[(5 * i + j) % 250 + 1 for j in range(6 + i % 5)] for i in range(12)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, *ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[str]:
    """What one offline engine makes of PROMPTS."""
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def scale(server, size: int, path: str = "/scale", field: str = "data_parallel_size",
          headers: dict | None = None) -> tuple[int, dict]:
    status, raw = server.request("POST", path, {field: size},
                                 headers=ADMIN if headers is None else headers, timeout=300)
    return status, json.loads(raw)


def ranks(server) -> dict[str, str]:
    return server.get_json("/health")[1]["ranks"]


def engine_ranks(server) -> set[int]:
    """The ranks whose engine process lives."""
    found = set()
    for proc in live(server.current_tree()):
        with contextlib.suppress(psutil.Error):
            title = " ".join(proc.cmdline())
            found.update(r for r in range(4) if f"parashift-engine-dp{r}" in title)
    return found


def complete(server, i: int, stream: bool) -> str:
    """PROMPTS[i] greedy; a stream's text is put together from its events."""
    status, raw = server.request("POST", "/v1/completions", {
        "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "stream": stream}, timeout=120)
    assert status == 200, raw
    if not stream:
        return json.loads(raw)["choices"][0]["text"]
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert not any("error" in e for e in events), events
    finished = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
    assert finished[-1] == "length", events  # complete
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def test_one_to_three_and_back_under_load_loses_nothing(server, expected):
    assert ranks(server) == {"dp0": "serving"}
    stop, results, errors = threading.Event(), [], []

    def client(worker: int) -> None:
        n = worker
        while not stop.is_set():
            i = n % len(PROMPTS)
            try:
                results.append((i, complete(server, i, stream=n % 2 == 0)))
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(repr(e))
            n += 3

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        clients = [pool.submit(client, w) for w in range(3)]
        try:
            assert scale(server, 2) == (200, {"data_parallel_size": 2})
            assert ranks(server) == {"dp0": "serving", "dp1": "serving"}
            # On CPU the layout is the capacity's: the new rank's cores are not dp0's.
            cores = [set(server.engine_process(r).cpu_affinity()) for r in (0, 1)]
            assert len(os.sched_getaffinity(0)) < 2 or cores[0].isdisjoint(cores[1]), cores
            assert scale(server, 3, "/scale_elastic_ep", "new_data_parallel_size") == (
                200, {"data_parallel_size": 3})
            assert ranks(server) == {"dp0": "serving", "dp1": "serving", "dp2": "serving"}
            assert engine_ranks(server) == {0, 1, 2}
            while server.metric("parashift_engine_requests_total", 'engine="dp2"') is None:
                complete(server, 0, stream=False)  # until dp2 has served one (routing by load)
            assert scale(server, 1) == (200, {"data_parallel_size": 1})
        finally:
            stop.set()
            for c in clients:
                c.result()
    assert errors == []
    assert results and all(text == expected[i] for i, text in results)
    assert ranks(server) == {"dp0": "serving"}
    assert engine_ranks(server) == {0}  # dp1 and dp2 stopped
    assert server.metric("parashift_data_parallel_size") == 1.0
    assert complete(server, 3, stream=True) == expected[3]


def test_pools_scale_their_decode_pool(tiny_llama):
    """p1xd1 -> p1xd2 -> p1xd1: the new rank decodes handed-off prompts (its tier loads), the
    answers stay those of the launch size, and the prefill pool and one decode rank stay."""
    prompt = [(7 * j) % 250 + 1 for j in range(40)]  # two whole blocks to hand off
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    def answer(server) -> str:
        status, raw = server.request("POST", "/v1/completions", body, timeout=120)
        assert status == 200, raw
        return json.loads(raw)["choices"][0]["text"]

    def tier_loads(server) -> float:
        return server.metric("parashift_kv_tier_loads", 'engine="dp2",tier="host"') or 0.0

    with running_server(tiny_llama, *BASE, "--strategy", "p1xd1", "--data-parallel-size-max",
                        "3", "--admin-api-key", KEY) as pools:
        before = answer(pools)
        assert scale(pools, 3) == (200, {"data_parallel_size": 3})
        assert ranks(pools) == {"dp0": "serving", "dp1": "serving", "dp2": "serving"}
        with concurrent.futures.ThreadPoolExecutor(4) as clients:
            for _ in range(10):  # side by side, so that the least loaded decode rank is dp2
                assert list(clients.map(lambda _: answer(pools), range(4))) == [before] * 4
                if tier_loads(pools) > 0.0:
                    break
        assert tier_loads(pools) > 0.0, "dp2 decoded nothing"
        status, refused = scale(pools, 1)
        assert status == 400 and "keeps its 1 prefill rank" in refused["error"]["message"]
        assert scale(pools, 2) == (200, {"data_parallel_size": 2})
        assert ranks(pools) == {"dp0": "serving", "dp1": "serving"}
        assert engine_ranks(pools) == {0, 1}
        assert answer(pools) == before


def test_what_a_scale_refuses(server):
    status, body = scale(server, 4)
    assert status == 400 and "--data-parallel-size-max 3" in body["error"]["message"]
    assert scale(server, 1) == (200, {"data_parallel_size": 1})  # the size it has: nothing
    assert scale(server, 2, headers={})[0] == 401  # the admin key
    status, raw = server.request("POST", "/scale", {"data_parallel_size": "two"},
                                 headers=ADMIN)
    assert status == 400 and b"data_parallel_size" in raw
    status, raw = server.request("POST", "/scale", {"size": 2}, headers=ADMIN)
    assert status == 400
    assert ranks(server) == {"dp0": "serving"}


def test_scales_asked_together_take_their_turns(server):
    """Two scales asked at once each run, one after the other, and each answers with its
    size; the server ends at the size of the one that ran last."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda size: scale(server, size), (2, 3)))
    assert sorted(answers, key=lambda a: a[1]["data_parallel_size"]) == [
        (200, {"data_parallel_size": 2}), (200, {"data_parallel_size": 3})]
    final = len(ranks(server))
    assert final in (2, 3) and ranks(server) == {f"dp{r}": "serving" for r in range(final)}
    assert scale(server, 1) == (200, {"data_parallel_size": 1})


def test_asleep_a_scale_is_refused_with_409(server):
    assert server.request("POST", "/sleep?level=1", headers=ADMIN, timeout=120)[0] == 200
    try:
        status, body = scale(server, 2)  # at once: the engines are asked, not the vector
        assert status == 409 and "asleep" in body["error"]["message"]
    finally:
        assert server.request("POST", "/wake_up", headers=ADMIN, timeout=120)[0] == 200


def test_parashift_scale_command(server):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "parashift.cli", "scale", *args,
                               "--url", server.url, "--admin-api-key", KEY],
                              capture_output=True, text=True, timeout=300, cwd="/")

    done = run("2")
    assert done.returncode == 0 and "data parallel size 2" in done.stdout, done.stderr
    refused = run("9")
    assert refused.returncode == 2 and "400" in refused.stderr, refused.stderr
    assert run("1").returncode == 0
    assert ranks(server) == {"dp0": "serving"}


# --- a drain that runs out of time, and a new rank that dies -----------------------------------
@pytest.fixture(scope="module")
def impatient(tiny_llama_long):
    """dp2 that may go down to 1 with no time to drain."""
    with running_server(tiny_llama_long, *LONG_ARGS, "--strategy", "dp2",
                        "--data-parallel-size-max", "2", "--drain-timeout", "0",
                        "--admin-api-key", KEY) as s:
        yield s


def test_past_the_drain_timeout_a_stream_ends_with_an_error_naming_the_drain(impatient):
    """A stream on the leaving rank that has shown tokens cannot move: it ends with an error
    event that names the scale-down; the server goes on at the new size."""
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": LONG_MAX_MODEL_LEN - 3, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(impatient.url + "/v1/completions", data=body, headers={
        "Content-Type": "application/json", "X-data-parallel-rank": "1"})
    with urllib.request.urlopen(req, timeout=120) as stream:
        lines = []
        for line in stream:  # up to its first token: it runs on dp1
            lines.append(line)
            if b'"text"' in line:
                break
        assert scale(impatient, 1) == (200, {"data_parallel_size": 1})
        lines += list(stream)
    events = [json.loads(line[6:]) for line in lines
              if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"]
    errors = [e["error"]["message"] for e in events if "error" in e]
    assert errors and "scale-down" in errors[0] and "--drain-timeout" in errors[0], (
        events[-2:], impatient.output()[-4000:])
    assert ranks(impatient) == {"dp0": "serving"}
    assert impatient.request("POST", "/v1/completions", {
        "prompt": [1, 2], "max_tokens": 4, "temperature": 0})[0] == 200


def test_a_new_rank_that_dies_fails_the_scale_and_the_size_stays(impatient):
    assert scale(impatient, 1) == (200, {"data_parallel_size": 1})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(scale, impatient, 2)
        while 1 not in engine_ranks(impatient):  # the new engine's process is up
            assert not answer.done(), answer.result()
        for proc in live(impatient.current_tree()):
            with contextlib.suppress(psutil.Error):
                if "parashift-engine-dp1" in " ".join(proc.cmdline()):
                    proc.kill()
        status, body = answer.result()
    assert status == 503 and "dp1" in body["error"]["message"], body
    assert ranks(impatient) == {"dp0": "serving"}
    assert impatient.request("POST", "/v1/completions", {
        "prompt": [1, 2], "max_tokens": 4, "temperature": 0})[0] == 200


# --- the autoscaler --------------------------------------------------------------------------
def test_the_autoscaler_grows_on_a_backlog_and_shrinks_when_idle(tiny_llama_long):
    """dp1 that may grow to 2: bursts of long prompts (prefilled 256 tokens a step, so that
    they wait) are a backlog above the threshold (no window), so a rank is added; when the
    bursts are served the idle rank goes (no window). Every request is answered."""
    with running_server(tiny_llama_long, *LONG_ARGS, "--strategy", "dp1",
                        "--max-num-batched-tokens", "256",
                        "--data-parallel-size-min", "1", "--data-parallel-size-max", "2",
                        "--autoscale-up-tokens", "500", "--autoscale-up-window", "0",
                        "--autoscale-idle-window", "0") as server:
        prompt = [(3 * i) % 250 + 1 for i in range(3000)]

        def long_one(_: int) -> int:
            return server.request("POST", "/v1/completions", {
                "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True},
                timeout=300)[0]

        def logged(pattern: str) -> bool:
            return any(re.search(pattern, line) for line in list(server.lines))

        answers: list[int] = []
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            # The coordinator samples the load every 100 ms: bursts until one shows.
            while not logged(r"autoscaler: data parallel 1 -> 2"):
                answers += pool.map(long_one, range(8))
            answers += pool.map(long_one, range(8))  # one more, during the scale-up
            server.wait_line(r"data parallel size is 2 now")
        assert answers == [200] * len(answers)
        server.wait_line(r"autoscaler: data parallel 2 -> 1: 0\.00 of 2 ranks busy")
        while ranks(server) != {"dp0": "serving"}:  # its last scale (it may have flapped)
            server.wait_line(r"data parallel size is 1 now")


# --- several nodes ---------------------------------------------------------------------------
SECRET_ENV = {"PARASHIFT_CLUSTER_SECRET": "elastic-multi-node-secret-0123456789"}


@pytest.mark.slow
def test_a_headless_node_joins_a_running_head_and_a_scale_down_lets_it_go(tiny_llama,
                                                                           expected):
    """Two process trees on 127.0.0.1: a head serving dp1 (room for 3) and, later, a
    `--headless --data-parallel-start-rank 1` node whose rank joins the deployment; a
    POST /scale to 3 then starts dp2 on the head's node (beside the joined rank); a
    scale-down to 1 drains both, and the node exits on its own, cleanly."""
    head = launch(tiny_llama, [*BASE, "--strategy", "dp1", "--data-parallel-size-max", "3",
                               "--admin-api-key", KEY, "--data-parallel-address", "127.0.0.1",
                               "--data-parallel-rpc-port", "0"], env=SECRET_ENV)
    try:
        port = head.wait_line(r"handshake listens at tcp://127\.0\.0\.1:(\d+)").group(1)
        wait_serving(head)
        assert ranks(head) == {"dp0": "serving"}
        # A node that would leave a gap (dp1 is the next rank) is told why and stops.
        gap = launch(tiny_llama, [*BASE, "--headless", "--data-parallel-start-rank", "2",
                                  "--data-parallel-size-local", "1",
                                  "--data-parallel-address", "127.0.0.1",
                                  "--data-parallel-rpc-port", port], env=SECRET_ENV)
        try:
            assert gap.wait_exit(120) != 0
            assert ("refused this node: ranks dp2-dp2 refused: a node that joins takes the "
                    "ranks from dp1, the current size") in "".join(gap.lines)
        finally:
            stop(gap)
        node = launch(tiny_llama, [*BASE, "--headless", "--data-parallel-start-rank", "1",
                                   "--data-parallel-size-local", "1",
                                   "--data-parallel-address", "127.0.0.1",
                                   "--data-parallel-rpc-port", port], env=SECRET_ENV)
        try:
            head.wait_line(r"headless node's ranks joined: data parallel size 1 -> 2")
            while ranks(head) != {"dp0": "serving", "dp1": "serving"}:
                head.wait_line(r"engine dp1 ready")  # the API server's view follows
            for i in range(len(PROMPTS)):
                assert complete(head, i, stream=i % 2 == 0) == expected[i]
            assert head.metric("parashift_engine_requests_total", 'engine="dp1"') > 0
            assert scale(head, 3) == (200, {"data_parallel_size": 3})
            assert ranks(head) == {"dp0": "serving", "dp1": "serving", "dp2": "serving"}
            assert 2 in engine_ranks(head) and node.proc.poll() is None  # dp2: the head's
            for i in range(len(PROMPTS)):
                assert complete(head, i, stream=i % 2 == 1) == expected[i]
            assert head.metric("parashift_engine_requests_total", 'engine="dp2"') > 0
            assert scale(head, 1) == (200, {"data_parallel_size": 1})
            assert node.proc.wait(60) == 0, "".join(node.lines)  # it exits on its own
            assert ranks(head) == {"dp0": "serving"}
            assert complete(head, 0, stream=True) == expected[0]
        finally:
            stop(node)
    finally:
        stop(head)

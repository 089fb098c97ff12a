"""One `parashift run --strategy dp2xep` server (async scheduling, a small KV cache): its
lockstep waves start and stop on their own, with one dummy step per engine after the last
request, then no engine steps or spins; under random arrivals, aborts and preemption every
request ends and every KV block comes back; constrained requests, a request that arrives as a
wave ends and a sleep mid-wave are served as they should be. Outputs equal one engine holding
every expert (test_expert_parallel.py's helpers; conftest.py's `mixtral`)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import random
import re
import time

import psutil
import pytest

from parashift import LLM, SamplingParams

from .servers import running_server
from .test_expert_parallel import ARGS, MAX_TOKENS, PROMPTS, assert_matches, complete, reference


def drop_after_first_chunk(server, prompt, max_tokens, rank=None) -> None:
    """Stream a completion and close the connection at its first event: the API server
    aborts the request in its engine."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Content-Type": "application/json"}
    if rank is not None:
        headers["X-data-parallel-rank"] = str(rank)
    conn.request("POST", "/v1/completions", json.dumps({
        "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}),
        headers)
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")
    conn.close()


def lockstep_state(server, num_engines: int) -> dict[str, list[float]]:
    """Each engine's lockstep counters and load, from one scrape of /metrics."""
    status, raw = server.request("GET", "/metrics")
    assert status == 200, raw
    text = raw.decode()

    def series(name: str) -> list[float]:
        values = []
        for rank in range(num_engines):
            m = re.search(rf'^{name}\{{engine="dp{rank}"\}} (\S+)$', text, re.MULTILINE)
            values.append(0.0 if m is None else float(m.group(1)))
        return values

    return {"dummy_steps": series("parashift_lockstep_dummy_steps"),
            "waves": series("parashift_lockstep_waves"),
            "in_wave": series("parashift_lockstep_in_wave"),
            "requests": [a + b for a, b in zip(series("parashift_num_requests_running"),
                                               series("parashift_num_requests_waiting"),
                                               strict=True)],
            "kv_usage": series("parashift_kv_cache_usage_ratio"),
            "prefill_held": series("parashift_lockstep_prefill_held_steps")}


def poll(server, num_engines: int, done, what: str, timeout: float = 60.0
         ) -> dict[str, list[float]]:
    """The first lockstep state for which `done(state)` holds."""
    deadline = time.monotonic() + timeout
    while not done(state := lockstep_state(server, num_engines)):
        assert time.monotonic() < deadline, f"{what}: {state}\n{server.output()[-3000:]}"
        time.sleep(0.05)
    return state


def wave_ended(server, before: dict[str, list[float]], min_dummy_steps: list[int]
               ) -> dict[str, list[float]]:
    """The state once every engine has ended a wave since `before` and run at least
    `min_dummy_steps` more dummy steps: an engine reports its counters when a wave ends, so
    the wave's last (dummy) step is counted by then."""
    return poll(server, len(min_dummy_steps), lambda s: all(
        w > w0 and d >= d0 + n for w, w0, d, d0, n in zip(
            s["waves"], before["waves"], s["dummy_steps"], before["dummy_steps"],
            min_dummy_steps, strict=True)), f"no wave ended after {before}")


def fence(server) -> dict[str, list[float]]:
    """The state after a wave whose end is known: once no engine has requests or is in a wave
    (its counters are final: they go out in the same report as the wave's end), one request
    that prefills on dp1 and stops (a wave of its step and the dummy step that ends it)."""
    before = poll(server, 2, lambda s: not any(s["requests"]) and not any(s["in_wave"]),
                  "requests or a wave left")
    assert complete(server, PROMPTS[0], rank=1, max_tokens=1)
    return wave_ended(server, before, [2, 1])


def cpu_ticks(procs: list[psutil.Process]) -> list[int]:
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    return [round((t.user + t.system) * ticks_per_s) for t in (p.cpu_times() for p in procs)]


def assert_stays_idle(server, num_engines: int, state: dict[str, list[float]],
                      window_s: float, check_cpu: bool) -> None:
    """Over `window_s` seconds from now no engine steps (its counters stay at `state`'s,
    checked all along) and, with `check_cpu`, none uses more than 2% of a core (plus one
    clock tick of rounding): an idle engine blocks in its poll, one that spins uses ~all."""
    engines = [server.engine_process(r) for r in range(num_engines)]
    start, ticks = time.monotonic(), cpu_ticks(engines)
    while (elapsed := time.monotonic() - start) < window_s:
        now = lockstep_state(server, num_engines)
        assert (now["dummy_steps"], now["waves"]) == (state["dummy_steps"], state["waves"]), now
        time.sleep(0.1)
    if check_cpu:
        used = [b - a for a, b in zip(ticks, cpu_ticks(engines), strict=True)]
        allowed = 0.02 * elapsed * os.sysconf("SC_CLK_TCK") + 1
        assert all(u <= allowed for u in used), (used, allowed, elapsed)


@pytest.fixture(scope="module")
def dp2xep(mixtral):
    """A small KV cache (48 blocks of 16 tokens per engine): many requests at once preempt.
    Asked for async scheduling: lockstep waves step one at a time, and match the reference."""
    args = [a if a != "32MiB" else "384KiB" for a in ARGS]
    with running_server(mixtral, *args, "--strategy", "dp2xep", "--async-scheduling",
                        "--enable-admin-routes") as s:  # sleeps a lockstep group
        yield s


def test_one_request_runs_one_wave_with_one_dummy_step_after(dp2xep):
    """The serving rank runs one dummy step (the wave's last, where no rank had work); the
    other runs one per step of the wave. Then they block: no more steps, almost no CPU."""
    s = dp2xep
    before = fence(s)
    prompt = PROMPTS[0]  # one prefill step, then a decode step per further token
    assert len(complete(s, prompt, rank=1)["logprobs"]["tokens"]) == MAX_TOKENS
    after = wave_ended(s, before, [0, 0])
    assert after["waves"] == [w + 1 for w in before["waves"]], (before, after)
    added = [a - b for a, b in zip(after["dummy_steps"], before["dummy_steps"], strict=True)]
    assert added == [MAX_TOKENS + 1, 1], added
    assert_stays_idle(s, 2, after, window_s=3.0, check_cpu=True)


def test_dp2xep_matches_one_engine_with_every_expert(dp2xep, mixtral):
    assert_matches(dp2xep, reference(mixtral), [0, 1])
    assert_matches(dp2xep, reference(mixtral), [1])  # dp0 runs only dummy steps
    # The group's store (hosted by the launcher) and gloo listen on 127.0.0.1 alone.
    assert dp2xep.wildcard_listeners() == []


def test_the_prefill_cadence_holds_a_long_prompts_chunks_and_changes_no_answer(mixtral):
    """--prefill-schedule-interval 2 with 32-token steps: a 100-token prompt runs its chunks
    on the wave's even steps only (the held-steps counter moves) while the other rank decodes;
    every answer is the reference's."""
    long_prompt = [(13 * j) % 250 + 1 for j in range(100)]
    llm = LLM(mixtral, dtype="float32", max_model_len=256, kv_cache_memory=32 << 20)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = llm.generate([long_prompt], params, use_tqdm=False)[0].outputs[0].text
    finally:
        llm.shutdown()
    with running_server(mixtral, *ARGS, "--strategy", "dp2xep", "--prefill-schedule-interval",
                        "2", "--max-num-batched-tokens", "32") as s:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            other = pool.submit(complete, s, PROMPTS[1], 1, 40)
            assert complete(s, long_prompt, rank=0)["text"] == expected
            other.result()
        poll(s, 2, lambda state: state["prefill_held"][0] > 0, "no step held prefill work")
        assert_matches(s, reference(mixtral), [0, 1])


def expert_tokens(server) -> dict[str, list[float]]:
    """Each engine's parashift_expert_routed_tokens, by expert id."""
    status, raw = server.request("GET", "/metrics")
    assert status == 200, raw
    found: dict[str, dict[int, float]] = {}
    for engine, expert, value in re.findall(
            r'^parashift_expert_routed_tokens\{engine="(dp\d)",expert="(\d+)"\} (\S+)$',
            raw.decode(), re.MULTILINE):
        found.setdefault(engine, {})[int(expert)] = float(value)
    return {e: [c[i] for i in sorted(c)] for e, c in found.items()}


def test_the_expert_load_counts_each_engines_own_tokens_per_expert(dp2xep, mixtral):
    """A fresh prompt of P tokens and T output tokens runs P + T - 1 tokens through each of
    the L MoE layers, top-k experts each: dp1's counts grow by exactly that, spread over the
    experts; dp0's (dummy steps only) do not move."""
    config = json.load(open(os.path.join(mixtral, "config.json")))
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    prompt = [(17 * j) % 250 + 5 for j in range(40)]
    fence(dp2xep)
    before = expert_tokens(dp2xep)
    state = lockstep_state(dp2xep, 2)
    assert len(complete(dp2xep, prompt, rank=1)["logprobs"]["tokens"]) == MAX_TOKENS
    wave_ended(dp2xep, state, [0, 0])
    after = expert_tokens(dp2xep)
    assert len(after["dp1"]) == config["num_local_experts"]
    added = [a - b for a, b in zip(after["dp1"], before["dp1"], strict=True)]
    assert sum(added) == (len(prompt) + MAX_TOKENS - 1) * layers * top_k, added
    assert sum(1 for a in added if a) >= 2  # routed to several experts
    assert after.get("dp0") == before.get("dp0")


def test_constrained_requests_in_a_wave(dp2xep):
    """Structured outputs under lockstep: each rank's constrained request samples within its
    grammar while the other rank steps beside it."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["n"]}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda rank: dp2xep.request("POST", "/v1/completions", {
            "prompt": PROMPTS[rank], "max_tokens": 30, "temperature": 1.0, "seed": rank,
            "structured_outputs": {"json": schema}}, {"X-data-parallel-rank": str(rank)}),
            (0, 1)))
    for status, raw in results:
        choice = json.loads(raw)["choices"][0]
        assert status == 200 and choice["finish_reason"] == "stop", raw
        assert 0 <= json.loads(choice["text"])["n"] <= 99


def test_random_arrivals_aborts_and_preemption_all_end_and_the_waves_stop(dp2xep):
    """200 requests of random lengths arriving at random times, some pinned, one in ten
    dropped by its client after the first token (an abort), 64 at once on a small KV cache
    (so requests are preempted): every other request completes with all its tokens, the KV
    blocks all come back, then no engine steps."""
    rng = random.Random(7)
    # The first 64 at once (a burst that overflows the KV cache), the rest over 2 s.
    jobs = [([rng.randrange(1, 250) for _ in range(rng.randrange(1, 60))],
             rng.choice([None, 0, 1]), rng.randrange(1, 40), 0 if i < 64 else rng.random() * 2,
             rng.random() < 0.1) for i in range(200)]
    preempted = sum(dp2xep.metric("parashift_num_preemptions", f'engine="dp{r}"') or 0
                    for r in (0, 1))

    def run(job):
        prompt, rank, max_tokens, delay, gives_up = job
        time.sleep(delay)
        if gives_up:  # a streamed request the client drops after its first token
            drop_after_first_chunk(dp2xep, prompt, 256 - len(prompt), rank)
            return None
        return len(complete(dp2xep, prompt, rank, max_tokens)["logprobs"]["tokens"])

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        lengths = list(pool.map(run, jobs))
    assert lengths == [None if job[4] else job[2] for job in jobs]
    # The aborted ones end in their engines too, and every KV block comes back.
    poll(dp2xep, 2, lambda s: not any(s["requests"]) and not any(s["kv_usage"]),
         "requests or KV blocks left")
    assert_stays_idle(dp2xep, 2, fence(dp2xep), window_s=1.0, check_cpu=False)
    assert sum(dp2xep.metric("parashift_num_preemptions", f'engine="dp{r}"') or 0
               for r in (0, 1)) > preempted


def test_a_request_that_arrives_as_a_wave_ends_is_served(dp2xep):
    """Each request starts right after the previous one finished, on the other rank, with a
    jittered gap: some land in the wave's last step, some just after it."""
    rng = random.Random(3)
    for i in range(30):
        time.sleep(rng.random() * 0.01)
        assert complete(dp2xep, PROMPTS[i % len(PROMPTS)], rank=i % 2, max_tokens=1,
                        timeout=20)


def test_sleep_waits_for_the_wave_then_the_whole_group_sleeps(dp2xep):
    """A sleep call while a request runs on dp0 (dp1 in the wave with dummy steps) is answered
    only once that request has all its tokens: no rank sleeps mid-wave. Both ranks sleep, a
    request meanwhile gets the 503, and after the wake the group serves again."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(complete, dp2xep, PROMPTS[0], 0, 120)
        while dp2xep.metric("parashift_num_requests_running", 'engine="dp0"') != 1:
            assert not running.done()
            time.sleep(0.02)
        status, body = dp2xep.request("POST", "/sleep?level=1", timeout=120)
        assert status == 200, body
        assert running.done() and len(running.result()["logprobs"]["tokens"]) == 120
    assert {e["level"] for e in json.loads(body)["engines"].values()} == {1}
    assert dp2xep.get_json("/is_sleeping")[1]["levels"] == {"dp0": 1, "dp1": 1}
    status, raw = dp2xep.request("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 503, raw
    assert dp2xep.request("POST", "/wake_up", timeout=60)[0] == 200
    for rank in (0, 1):
        assert complete(dp2xep, PROMPTS[1], rank=rank, max_tokens=2)

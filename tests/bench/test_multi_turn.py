"""`bench serve --dataset multi-turn`: the conversations (each round's prompt extends the one
before, the system prompt is every user's), the per-round arithmetic, the order of a user's
rounds against a stub server, and one run against a real `parashift run`."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from conftest import cli_in_process

from parashift.bench.metrics import RequestRecord
from parashift.bench.multi_turn import (
    MultiTurnSizes,
    conversations,
    format_rounds,
    load,
    per_round,
)
from parashift.bench.serve_client import run_load

SIZES = MultiTurnSizes(num_users=3, num_rounds=4, system_len=20, question_len=5, output_len=7)


def test_each_round_extends_the_last_by_its_answer_and_a_new_question():
    for turns in conversations(SIZES, vocab_size=1000, seed=1):
        assert len(turns) == 4
        assert [t.prompt_len for t in turns] == [20 + 5 + r * 12 for r in range(4)]
        for before, after in zip(turns, turns[1:], strict=False):
            assert after.prompt[:before.prompt_len] == before.prompt
        assert all(t.prompt_len == len(t.prompt) and t.output_len == 7 for t in turns)


def test_the_system_prompt_is_every_users_and_the_rest_is_theirs():
    users = conversations(SIZES, vocab_size=1000, seed=1)
    firsts = [turns[0].prompt for turns in users]
    assert firsts[0][:20] == firsts[1][:20] == firsts[2][:20]
    assert len({tuple(p[20:]) for p in firsts}) == 3  # different questions
    no_system = conversations(MultiTurnSizes(2, 2, 0, 5, 7), vocab_size=1000, seed=1)
    assert no_system[0][0].prompt_len == 5


def test_each_users_history_follows_the_system_prompt_and_is_theirs_alone():
    sizes = MultiTurnSizes(num_users=2, num_rounds=3, system_len=20, question_len=5,
                           output_len=7, history_len=30)
    users = conversations(sizes, vocab_size=1000, seed=1)
    for turns in users:
        assert [t.prompt_len for t in turns] == [20 + 30 + 5 + r * 12 for r in range(3)]
    a, b = (turns[0].prompt for turns in users)
    assert a[:20] == b[:20] and a[20:50] != b[20:50]


def test_the_ids_are_seeded_and_skip_the_special_range():
    a, b = conversations(SIZES, 1000, seed=4), conversations(SIZES, 1000, seed=4)
    assert [[t.prompt for t in u] for u in a] == [[t.prompt for t in u] for u in b]
    assert a[0][0].prompt != conversations(SIZES, 1000, seed=5)[0][0].prompt
    ids = [i for u in a for t in u for i in t.prompt]
    assert 100 <= min(ids) and max(ids) < 900


def test_the_load_lists_users_in_turn_each_round_following_the_last():
    conv = load(SIZES, 1000, seed=1)
    assert len(conv.requests) == 12
    assert conv.users == [u for u in range(3) for _ in range(4)]
    assert conv.rounds == [0, 1, 2, 3] * 3
    assert conv.follows == [None, 0, 1, 2, None, 4, 5, 6, None, 8, 9, 10]


@pytest.mark.parametrize("values", [dict(num_users=0), dict(num_rounds=0),
                                    dict(question_len=0), dict(output_len=0),
                                    dict(system_len=-1), dict(history_len=-1)])
def test_bad_sizes_name_their_flag(values):
    flag = {"num_users": "--multi-turn-users", "num_rounds": "--multi-turn-rounds",
            "question_len": "--multi-turn-question-len", "output_len": "--output-len",
            "system_len": "--multi-turn-system-len",
            "history_len": "--multi-turn-history-len"}[next(iter(values))]
    with pytest.raises(ValueError, match=flag):
        MultiTurnSizes(**values)


def test_per_round_groups_the_records_and_takes_their_percentiles():
    rounds, records = [], []
    ttfts = {0: [0.010 * (i + 1) for i in range(10)], 1: [0.5, 0.7]}
    for round_, values in ttfts.items():
        for ttft in values:
            records.append(RequestRecord(100 * (round_ + 1), 8, ttft=ttft, e2e=ttft + 1))
            rounds.append(round_)
    records.append(RequestRecord(200, 8, ttft=9.0, error="HTTP 500: boom"))  # not timed
    rounds.append(1)
    rows = per_round(records, rounds)
    assert [(r["round"], r["completed"], r["failed"]) for r in rows] == [(1, 10, 0), (2, 2, 1)]
    assert [r["mean_prompt_len"] for r in rows] == [100, 200]
    assert rows[0]["ttft_ms"]["median"] == pytest.approx(55.0)
    assert rows[0]["ttft_ms"]["p99"] == pytest.approx(np.percentile(ttfts[0], 99) * 1e3)
    assert rows[1]["ttft_ms"]["median"] == pytest.approx(600.0)
    text = format_rounds(rows)
    assert text.splitlines()[2].split() == ["1", "10", "0", "100", "55.0", "99.1"]
    assert text.splitlines()[3].split()[:4] == ["2", "2", "1", "200"]


def test_a_round_of_only_failures_prints_dashes():
    rows = per_round([RequestRecord(5, 8, error="HTTP 500: boom")], [0])
    assert rows[0]["ttft_ms"] == {} and format_rounds(rows).splitlines()[2].split()[-2:] == [
        "-", "-"]


def test_a_user_sends_a_round_only_once_the_last_one_finished():
    """A stub completions server records, for each prompt it receives, whether the prompt it
    extends (the user's last round) had been answered in full by then."""
    from aiohttp import web

    answered: set[tuple[int, ...]] = set()
    arrivals: list[tuple[int, bool]] = []  # (prompt length, its last round answered)
    in_flight, most_in_flight = 0, 0

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal in_flight, most_in_flight
        prompt = tuple((await request.json())["prompt"])
        # a first round is system + question (25 ids); a later one adds an answer and a question
        arrivals.append((len(prompt), len(prompt) == 25 or prompt[:-12] in answered))
        in_flight += 1
        most_in_flight = max(most_in_flight, in_flight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(7):
            await asyncio.sleep(0)  # let other users' requests in between the chunks
            await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        usage = {"choices": [], "usage": {"completion_tokens": 7}}
        await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        in_flight -= 1
        answered.add(prompt)
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            conv = load(SIZES, 1000, seed=2)
            return await run_load(f"http://127.0.0.1:{port}", "stub", conv.requests, rate=100.0,
                                  max_concurrency=2, follows=conv.follows)
        finally:
            await runner.cleanup()

    records, _ = asyncio.run(main())
    assert all(r.ok and r.generated == 7 for r in records)
    assert len(arrivals) == 12 and all(ok for _, ok in arrivals), arrivals
    assert most_in_flight <= 2


@pytest.mark.parametrize("args, message", [
    (["--input-len", "5"], "drop --input-len"),
    (["--multi-turn-users", "0"], "--multi-turn-users must be >= 1"),
])
def test_bad_flags_fail_naming_the_flag(args, message):
    result = cli_in_process("bench", "serve", "--base-url", "http://127.0.0.1:9",
                            "--dataset", "multi-turn", *args)
    assert result.exit_code != 0 and message in result.output, result.output


@pytest.mark.slow
def test_serve_multi_turn_against_a_real_server(tiny_llama, tmp_path):
    from serve.servers import TINY_ARGS, running_server

    out = tmp_path / "multi.json"
    with running_server(tiny_llama, *TINY_ARGS) as server:
        done = cli_in_process(
            "bench", "serve", "--base-url", server.url, "--dataset", "multi-turn",
            "--multi-turn-users", "3", "--multi-turn-rounds", "3", "--multi-turn-system-len",
            "16", "--multi-turn-history-len", "8", "--multi-turn-question-len", "8",
            "--output-len", "8", "--vocab-size", "300",
            "--max-concurrency", "2", "--save-json", str(out))
    assert done.exit_code == 0, done.output[-3000:]
    assert "Successful requests:              9" in done.output and "Per round:" in done.output
    doc = json.loads(out.read_text())
    results, requests = doc["results"], doc["requests"]
    assert doc["settings"]["multi_turn"] == {"num_users": 3, "num_rounds": 3, "system_len": 16,
                                             "question_len": 8, "output_len": 8,
                                             "history_len": 8}
    assert (results["completed"], results["failed"]) == (9, 0)
    assert [(r["round"], r["completed"], r["mean_prompt_len"]) for r in results["rounds"]] == [
        (1, 3, 32), (2, 3, 48), (3, 3, 64)]
    assert all(r["ttft_ms"]["p99"] >= r["ttft_ms"]["median"] > 0 for r in results["rounds"])
    assert sorted((r["user"], r["round"]) for r in requests) == [
        (u, k) for u in range(3) for k in (1, 2, 3)]
    for user in range(3):  # each round sent after the last one's answer came back
        mine = sorted((r for r in requests if r["user"] == user), key=lambda r: r["round"])
        for before, after in zip(mine, mine[1:], strict=False):
            assert after["start"] >= before["start"] + before["e2e"]
    assert results["output_tokens"] == 9 * 8 and results["output_throughput"] > 0

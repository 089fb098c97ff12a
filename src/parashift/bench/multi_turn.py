"""`parashift bench serve --dataset multi-turn`: simulated chat users, the usual yardstick of
prefix caching and KV-cache offloading (LMCache's multi-round QA benchmark).

Each of U users holds one conversation of R rounds, and every request carries the whole
conversation so far: a system prompt that all users share (the same ids), then the user's own
earlier history (LMCache's user history prompt: a long conversation or document that came
before the measured rounds), then each earlier round's question and answer, then the new
question. A user sends round r+1 only once round r has finished, so round r+1's prompt extends
round r's exactly: its prefix was computed one round ago and sits in the prefix cache, or in
whatever KV tier holds it by then. Users run concurrently, within --max-concurrency; the
request rate paces the users' first rounds. In a sweep each rate gets new conversations (seed
+ the rate's index), so that no rate finds the prefixes of the one before it cached.

Prompts are token ids, drawn as `random_requests` draws them, so no tokenizer is needed. The
completions endpoint answers with text, not token ids, and text need not tokenize back to the
ids that produced it; so the answer in the history is `output_len` ids drawn from the seed, not
the tokens the server generated (with ignore_eos, which every bench request sets, the server
generates exactly `output_len`, so the lengths agree). The cost: the server finds all of round
r's prompt cached but computes round r's answer again as part of round r+1's prompt, which a
client that sent back the generated ids would not make it do."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parashift.bench.datasets import BenchRequest
from parashift.bench.metrics import RequestRecord, distribution

NAME = "multi-turn"  # the --dataset value


@dataclass(frozen=True)
class MultiTurnSizes:
    num_users: int = 8
    num_rounds: int = 4
    system_len: int = 1000  # tokens of the shared system prompt (0: none)
    question_len: int = 100
    output_len: int = 128  # tokens of each answer
    history_len: int = 0  # tokens of each user's own history before the first round

    def __post_init__(self) -> None:
        for flag, value in (("--multi-turn-users", self.num_users),
                            ("--multi-turn-rounds", self.num_rounds),
                            ("--multi-turn-question-len", self.question_len),
                            ("--output-len", self.output_len)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1 (got {value})")
        for flag, value in (("--multi-turn-system-len", self.system_len),
                            ("--multi-turn-history-len", self.history_len)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0 (got {value})")


@dataclass(frozen=True)
class MultiTurnLoad:
    """The conversations as `run_load` takes them, user by user, round by round."""

    requests: list[BenchRequest]
    follows: list[int | None]  # each round waits for the same user's round before it
    users: list[int]
    rounds: list[int]  # from 0


def conversations(sizes: MultiTurnSizes, vocab_size: int, seed: int
                  ) -> list[list[BenchRequest]]:
    """[user][round]: round r's prompt is round r-1's prompt, its answer, a new question."""
    rng = np.random.default_rng(seed)
    lo, hi = (100, vocab_size - 100) if vocab_size > 300 else (0, vocab_size)  # skip specials

    def draw(n: int) -> list[int]:
        return rng.integers(lo, hi, size=n).tolist()

    system = draw(sizes.system_len)
    users = []
    for _ in range(sizes.num_users):
        history, turns = system + draw(sizes.history_len), []
        for _ in range(sizes.num_rounds):
            history += draw(sizes.question_len)
            turns.append(BenchRequest(list(history), len(history), sizes.output_len))
            history += draw(sizes.output_len)  # the answer (see the module docstring)
        users.append(turns)
    return users


def load(sizes: MultiTurnSizes, vocab_size: int, seed: int) -> MultiTurnLoad:
    requests, follows, users, rounds = [], [], [], []
    for user, turns in enumerate(conversations(sizes, vocab_size, seed)):
        for round_, request in enumerate(turns):
            follows.append(len(requests) - 1 if round_ else None)
            requests.append(request)
            users.append(user)
            rounds.append(round_)
    return MultiTurnLoad(requests, follows, users, rounds)


def per_round(records: list[RequestRecord], rounds: list[int]) -> list[dict]:
    """Per round (numbered from 1): completed and failed requests, the mean prompt length, and
    the TTFT distribution in ms (`distribution`'s keys: its p50 is `median`)."""
    out = []
    for round_ in range(max(rounds, default=-1) + 1):
        mine = [r for r, k in zip(records, rounds, strict=True) if k == round_]
        done = [r for r in mine if r.ok]
        out.append({"round": round_ + 1, "completed": len(done),
                    "failed": len(mine) - len(done),
                    "mean_prompt_len": sum(r.prompt_len for r in mine) / len(mine),
                    "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None])})
    return out


def format_rounds(rounds: list[dict]) -> str:
    lines = ["Per round:",
             f"{'round':>5}{'completed':>11}{'failed':>8}{'prompt len':>12}"
             f"{'TTFT p50 (ms)':>15}{'TTFT p99 (ms)':>15}"]
    for row in rounds:
        ttft = row["ttft_ms"]
        p50, p99 = ((f"{ttft['median']:.1f}", f"{ttft['p99']:.1f}") if ttft else ("-", "-"))
        lines.append(f"{row['round']:>5}{row['completed']:>11}{row['failed']:>8}"
                     f"{row['mean_prompt_len']:>12.0f}{p50:>15}{p99:>15}")
    return "\n".join(lines)

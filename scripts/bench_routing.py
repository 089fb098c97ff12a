"""`python scripts/bench_routing.py`: the dp routing policies side by side, served (dp2, one
core per engine). Two workloads per policy, on the same server:

- chat: C conversations that share a long system prompt, each one turn after another (the
  next user message follows the reply), the conversations at once: the prefix cache's case;
- random: prompts with no shared prefix, all at once: the case where the cache cannot help
  and only the balance counts.

Per policy and workload: total tokens/s, TTFT p50 (every request streams), the prefix-cache
hit rate (usage.prompt_tokens_details.cached_tokens of each stream's final usage chunk, over
prompt tokens) and how the requests split between the ranks."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request
from typing import Annotated, Any

import aiohttp
import typer

from parashift.bench.options import SaveJson
from parashift.cli_options import ModelArg, fail, setup_logging
from parashift.defaults import DEFAULT_ROUTING_BALANCE_THRESHOLD, DEFAULT_ROUTING_MIN_MATCH
from parashift.serve.prefix_router import ROUTING_POLICIES as POLICIES
from parashift.serve.prefix_router import RoutingConfig

RUN_ARGS = ["--strategy", "dp2", "--max-model-len", "2048", "--kv-cache-memory", "1GiB"]
SYSTEM = ("You are a careful assistant for a library. Answer in one short paragraph, cite the "
          "shelf a book sits on, and never invent a title. ") * 12


async def _turn(session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]],
                max_tokens: int) -> tuple[str, dict[str, Any], float]:
    """One streamed chat turn: the reply, its usage (the final chunk's) and its TTFT."""
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    async with session.post(url + "/v1/chat/completions", json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        if r.status != 200:
            raise RuntimeError(f"chat turn failed ({r.status}): {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"chat turn failed: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice["delta"]["content"])
    if usage is None or ttft is None:
        raise RuntimeError("a chat turn's stream had no usage chunk or no token")
    return "".join(text), usage, ttft


async def _chat(session: aiohttp.ClientSession, url: str, index: int, turns: int,
                max_tokens: int) -> list[tuple[dict[str, Any], float]]:
    messages = [{"role": "system", "content": SYSTEM}]
    turns_done = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Visitor {index}, question {turn}: where "
                                                    f"are the books on topic {index * 7 + turn}?"})
        reply, usage, ttft = await _turn(session, url, messages, max_tokens)
        messages.append({"role": "assistant", "content": reply})
        turns_done.append((usage, ttft))
    return turns_done


async def _chats(url: str, conversations: int, turns: int, max_tokens: int):
    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        done = await asyncio.gather(*(_chat(session, url, i, turns, max_tokens)
                                      for i in range(conversations)))
        return time.perf_counter() - start, [turn for conv in done for turn in conv]


def _routed(url: str) -> dict[int, float]:
    """Requests each rank got, by the counter of the API server that answers (with several API
    servers: that one's share)."""
    import re

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:  # nosec B310
        text = r.read().decode()
    return {int(rank): float(v) for rank, v in re.findall(
        r'^parashift_engine_requests_total{engine="dp(\d+)"} (\S+)$', text, re.MULTILINE)}


def measure(model: str | None, policy: str, conversations: int, turns: int, max_tokens: int,
            random_requests_: list, repeat: int, api_servers: int,
            thresholds: tuple[int, float] | None = None) -> dict[str, Any]:
    """`thresholds`: prefix routing's (balance threshold, min match); None: the defaults."""
    from study_server import reset_prefix_cache, running_server, send_all, warm_up

    label = policy if thresholds is None else f"{policy} {thresholds[0]}/{thresholds[1]:g}"
    row: dict[str, Any] = {"policy": label, "chat": [], "random": []}
    args = [*RUN_ARGS, "--routing", policy, "--api-server-count", str(api_servers)]
    if thresholds is not None:
        args += ["--routing-balance-threshold", str(thresholds[0]),
                 "--routing-min-match", str(thresholds[1])]
    with running_server(model, args) as server:
        warm_up(server.url, 49152)
        # One pass of both workloads outside the timings: the engines' first steps at each
        # batch shape pay one-off costs (GEMM kernels built per row-count bucket).
        asyncio.run(_chats(server.url, conversations, turns, max_tokens))
        send_all(server.url, random_requests_)
        for _ in range(repeat):
            reset_prefix_cache(server.url)
            before = _routed(server.url)
            seconds, turns_done = asyncio.run(_chats(server.url, conversations, turns,
                                                     max_tokens))
            after = _routed(server.url)
            usages = [usage for usage, _ in turns_done]
            prompt = sum(u["prompt_tokens"] for u in usages)
            cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
            tokens = prompt + sum(u["completion_tokens"] for u in usages)
            row["chat"].append({"seconds": seconds, "total_tokens_per_s": tokens / seconds,
                                "hit_rate": cached / prompt,
                                "ttft_p50_ms": 1e3 * statistics.median(t for _, t in turns_done),
                                "requests_per_rank": {r: after[r] - before.get(r, 0)
                                                      for r in after}})
            reset_prefix_cache(server.url)
            before = _routed(server.url)
            seconds, records = send_all(server.url, random_requests_)
            after = _routed(server.url)
            tokens = sum(r.prompt_len + r.generated for r in records)
            row["random"].append({"seconds": seconds, "total_tokens_per_s": tokens / seconds,
                                  "ttft_p50_ms": 1e3 * statistics.median(r.ttft for r in records),
                                  "requests_per_rank": {r: after[r] - before.get(r, 0)
                                                        for r in after}})
            chat, rand = row["chat"][-1], row["random"][-1]
            typer.echo(f"  {label}: chat {chat['total_tokens_per_s']:.1f} tok/s, TTFT p50 "
                       f"{chat['ttft_p50_ms']:.0f} ms, hit rate {chat['hit_rate']:.2f}; random "
                       f"{rand['total_tokens_per_s']:.1f} tok/s, TTFT p50 "
                       f"{rand['ttft_p50_ms']:.0f} ms")
    return row


def routing(
    model: ModelArg = None,
    conversations: Annotated[int, typer.Option(help="chats at once")] = 8,
    turns: Annotated[int, typer.Option(help="turns per chat")] = 6,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="reply tokens")] = 96,
    num_random: Annotated[int, typer.Option("--num-random", help="random prompts")] = 32,
    repeat: Annotated[int, typer.Option(help="runs per policy; min and median kept")] = 3,
    policies: Annotated[str, typer.Option(help="comma-separated")] = ",".join(POLICIES),
    api_server_count: Annotated[int, typer.Option(
        "--api-server-count", help="API servers, each with its own prefix index")] = 1,
    balance_thresholds: Annotated[str | None, typer.Option(
        "--balance-thresholds", help="prefix routing once per value of "
        "--routing-balance-threshold, e.g. 2,4,8 (with --min-matches: every pair)")] = None,
    min_matches: Annotated[str | None, typer.Option(
        "--min-matches", help="prefix routing once per --routing-min-match, e.g. 0.25,0.5")
                           ] = None,
    seed: int = 0,
    save_json: SaveJson = None,
) -> None:
    """The routing policies on a multi-turn chat and on prompts with no shared prefix."""
    setup_logging()
    from parashift.bench.datasets import random_requests

    chosen = [p.strip() for p in policies.split(",")]
    if any(p not in POLICIES for p in chosen):
        fail(f"--policies: use some of {', '.join(POLICIES)}")
    try:
        sweep = [(int(t), float(m)) for t in (balance_thresholds or
                                               str(DEFAULT_ROUTING_BALANCE_THRESHOLD)).split(",")
                 for m in (min_matches or str(DEFAULT_ROUTING_MIN_MATCH)).split(",")]
        for t, m in sweep:
            RoutingConfig("prefix", t, m)
    except ValueError as e:
        fail(f"--balance-thresholds / --min-matches: {e}")
    swept = balance_thresholds is not None or min_matches is not None
    randoms = random_requests(num_random, (32, 256), (32, 128), 49152, seed)
    rows = [measure(model, p, conversations, turns, max_tokens, randoms, repeat,
                    api_server_count, pair)
            for p in chosen for pair in (sweep if p == "prefix" and swept else [None])]
    typer.echo(f"\n{'policy':<13}{'chat tok/s min/median':>24}{'TTFT p50 ms':>13}"
               f"{'hit rate':>10}{'random tok/s min/median':>26}{'TTFT p50 ms':>13}"
               f"  requests per rank (chat | random)")
    for row in rows:
        chat = [r["total_tokens_per_s"] for r in row["chat"]]
        rand = [r["total_tokens_per_s"] for r in row["random"]]
        hit = statistics.median(r["hit_rate"] for r in row["chat"])
        chat_ttft = statistics.median(r["ttft_p50_ms"] for r in row["chat"])
        rand_ttft = statistics.median(r["ttft_p50_ms"] for r in row["random"])
        split = (row["chat"][-1]["requests_per_rank"], row["random"][-1]["requests_per_rank"])
        typer.echo(f"{row['policy']:<13}{min(chat):>12.1f} / {statistics.median(chat):<9.1f}"
                   f"{chat_ttft:>13.0f}{hit:>10.2f}{min(rand):>14.1f} / "
                   f"{statistics.median(rand):<9.1f}{rand_ttft:>13.0f}  {split[0]} | {split[1]}")
    if save_json:
        from parashift.bench.report import save_json as write

        write(save_json, "bench routing", {
            "conversations": conversations, "turns": turns, "max_tokens": max_tokens,
            "num_random": num_random, "repeat": repeat, "run_args": RUN_ARGS, "seed": seed,
            "api_server_count": api_server_count, "prefix_thresholds": sweep},
            {"policies": rows})


if __name__ == "__main__":
    typer.run(routing)

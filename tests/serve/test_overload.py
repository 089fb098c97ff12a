"""Overload without engines: the drain rate and the Retry-After it gives, the retry choice of
a request a full rank refused, a decode phase every rank refused (prefill/decode pools), and a
stream on a rank a scale-down removes (a real broker, its
sends recorded instead of sent; the engines' answers delivered as its receive task would)."""

from __future__ import annotations

import asyncio

import pytest

from parashift.serve.engine_client import EngineClient
from parashift.serve.engine_errors import (
    EngineDeadError,
    EngineUnavailableError,
    RequestFailedError,
)
from parashift.serve.generation import Generation
from parashift.serve.handoff import HANDED_OFF, EnginePools
from parashift.serve.overload import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    RETRY_AFTER_UNKNOWN_S,
    DrainRate,
    RetryLaterError,
    retry_after,
)
from parashift.types.outputs import EngineCoreOutput, SchedulerStats
from parashift.types.sampling_params import SamplingParams
from parashift.wire import protocol as p

FULL = "the engine holds 8 requests already, waiting (--max-waiting-requests): try again later"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_drain_rate_counts_recent_finishes_and_forgets_old_ones():
    clock = Clock()
    drain = DrainRate(window=4, horizon_s=10.0, clock=clock)
    assert drain.per_second() is None
    drain.on_finished()
    assert drain.per_second() is None  # one finish is no rate
    clock.now += 1.0
    drain.on_finished(3)
    assert drain.per_second() == 4 / 1.0
    clock.now += 1.0  # nothing finished since: the rate falls
    assert drain.per_second() == 4 / 2.0
    drain.on_finished(2)  # the window keeps the last 4 finishes
    assert drain.per_second() == 4 / 1.0
    clock.now += 11.0
    assert drain.per_second() is None  # all older than the horizon


def test_retry_after_is_the_backlog_over_the_drain_rate_within_bounds():
    assert retry_after(8, None) == RETRY_AFTER_UNKNOWN_S
    assert retry_after(8, 4.0) == 2.0
    assert retry_after(1, 1000.0) == RETRY_AFTER_MIN_S
    assert retry_after(10_000, 0.01) == RETRY_AFTER_MAX_S


@pytest.fixture
def broker(tmp_path):
    """dp3, every rank ready; `sent` records (rank, message) instead of sending."""
    client = EngineClient(0, f"ipc://{tmp_path}/requests", f"ipc://{tmp_path}/outputs", 3)
    client.sent = []
    client._send_to = lambda rank, msg: client.sent.append((rank, msg))
    for rank in range(3):
        client.on_ready(p.EngineReady(rank, 256, 100, 0, 16))
    yield client
    client.ctx.destroy(linger=0)


def load(broker: EngineClient, waiting: dict[int, int]) -> None:
    """`waiting` requests of 100 prompt tokens on each rank."""
    broker.take_load(p.LoadVector(1, [
        p.EngineLoad(r, SchedulerStats(n, 1, 0.0, prefill_tokens_left=100 * n))
        for r, n in waiting.items()]))


def test_the_retry_choice_is_the_least_loaded_rank_that_has_not_refused(broker):
    load(broker, {0: 8, 1: 3, 2: 1})
    assert broker.pick_engine() == 2
    assert broker.pick_engine(exclude={2}) == 1
    assert broker.pick_engine(exclude={1, 2}) == 0
    with pytest.raises(EngineUnavailableError):
        broker.pick_engine(exclude={0, 1, 2})


def adds(broker: EngineClient) -> list[tuple[int, str]]:
    return [(rank, msg.request_id) for rank, msg in broker.sent
            if isinstance(msg, p.AddRequest)]


def aborts(broker: EngineClient) -> list[tuple[int, list[str]]]:
    return [(rank, msg.request_ids) for rank, msg in broker.sent
            if isinstance(msg, p.AbortRequests)]


async def consume(gen: Generation) -> list[str]:
    return [delta.text async for delta in gen.stream()]


def test_a_refused_request_moves_to_a_rank_with_room(broker, tiny_tokenizer):
    async def scenario() -> None:
        load(broker, {0: 0, 1: 2, 2: 4})
        gen = Generation(broker, tiny_tokenizer, "cmpl-x", [[5, 6, 7]],
                         [SamplingParams(max_tokens=2, n=2)], None, None)
        assert adds(broker) == [(0, "cmpl-x-0-0"), (0, "cmpl-x-0-1")]
        reader = asyncio.create_task(consume(gen))
        broker.in_flight.fail("cmpl-x-0-1", 0, RequestFailedError(FULL, 429))
        await asyncio.sleep(0)  # the stream moves the whole request: both samples to dp1
        assert adds(broker)[2:] == [(1, "cmpl-x-0-0.1"), (1, "cmpl-x-0-1.1")]
        assert aborts(broker) == [(0, ["cmpl-x-0-0"])]  # dp0 had taken one of them
        for sample in ("cmpl-x-0-0.1", "cmpl-x-0-1.1"):
            broker.in_flight.deliver(EngineCoreOutput(sample, [40, 41], finish_reason="length"))
        await asyncio.wait_for(reader, 5)
        assert [c.token_ids for c in gen.choices.values()] == [[40, 41], [40, 41]]
        assert broker.in_flight.sinks == {}

    asyncio.run(scenario())


def test_refused_by_every_live_rank_is_a_429_that_says_when_to_retry(broker, tiny_tokenizer):
    async def scenario() -> None:
        broker.mark_dead(2, "killed")
        clock = Clock()
        broker.loads.drain = DrainRate(clock=clock)
        broker.loads.drain.on_finished(10)  # this server saw 10 requests finish in 2 s
        clock.now += 2.0
        gen = Generation(broker, tiny_tokenizer, "cmpl-y", [[5, 6, 7]],
                         [SamplingParams(max_tokens=2)], None, None)
        reader = asyncio.create_task(consume(gen))
        first = adds(broker)[0][0]
        broker.in_flight.fail("cmpl-y-0-0", first, RequestFailedError(FULL, 429))
        await asyncio.sleep(0)
        second = adds(broker)[1][0]
        assert {first, second} == {0, 1}
        broker.in_flight.fail("cmpl-y-0-0.1", second, RequestFailedError(FULL, 429))
        with pytest.raises(RetryLaterError) as refused:
            await asyncio.wait_for(reader, 5)
        error = refused.value
        assert error.status == 429 and error.type == "rate_limit_error"
        assert "--max-waiting-requests" in error.message
        assert "every live rank's waiting queue is full" in error.message
        # it holds nothing else on the full ranks: one finish, at 5 per second
        assert error.retry_after == 1 / 5
        assert len(broker.loads.room) == 0

    asyncio.run(scenario())


def test_refused_by_every_live_rank_it_takes_the_slot_a_finish_frees(broker, tiny_tokenizer):
    async def scenario() -> None:
        broker.mark_dead(2, "killed")
        broker.in_flight.add("other", 1, lambda item: None)  # another request, on dp1
        gen = Generation(broker, tiny_tokenizer, "cmpl-w", [[5, 6, 7]],
                         [SamplingParams(max_tokens=2)], None, None)
        reader = asyncio.create_task(consume(gen))
        assert adds(broker) == [(0, "cmpl-w-0-0")]
        broker.in_flight.fail("cmpl-w-0-0", 0, RequestFailedError(FULL, 429))
        while len(adds(broker)) < 2:
            await asyncio.sleep(0)
        broker.in_flight.fail("cmpl-w-0-0.1", 1, RequestFailedError(FULL, 429))
        while not broker.loads.room:  # every live rank refused it: it waits for room
            await asyncio.sleep(0)
        assert len(adds(broker)) == 2
        broker.in_flight.deliver(EngineCoreOutput("other", [9], finish_reason="length"))
        while len(adds(broker)) < 3:
            await asyncio.sleep(0)
        assert adds(broker)[2] == (0, "cmpl-w-0-0.2")  # the least loaded now
        broker.in_flight.deliver(EngineCoreOutput("cmpl-w-0-0.2", [40, 41],
                                                  finish_reason="length"))
        await asyncio.wait_for(reader, 5)
        assert gen.choices["cmpl-w-0-0"].token_ids == [40, 41]

    asyncio.run(scenario())


def test_a_pinned_request_is_not_moved(broker, tiny_tokenizer):
    async def scenario() -> None:
        broker.loads.drain.on_finished(100)  # a fast drain: a short wait for room
        gen = Generation(broker, tiny_tokenizer, "cmpl-z", [[5, 6, 7]],
                         [SamplingParams(max_tokens=2)], None, 1)
        reader = asyncio.create_task(consume(gen))
        broker.in_flight.fail("cmpl-z-0-0", 1, RequestFailedError(FULL, 429))
        with pytest.raises(RetryLaterError):
            await asyncio.wait_for(reader, 5)
        assert adds(broker) == [(1, "cmpl-z-0-0")]

    asyncio.run(scenario())


def test_each_attempt_has_engine_ids_of_its_own(broker, tiny_tokenizer):
    """A pinned request refused, woken by a finish and sent to the same rank again: the retry's
    engine ids are new, an output of the aborted first attempt still on the way never reaches
    it, and a stop string's abort names the retry's id."""
    async def scenario() -> None:
        broker.in_flight.add("other", 1, lambda item: None)  # its finish will free a slot
        gen = Generation(broker, tiny_tokenizer, "cmpl-p", [[5, 6, 7]],
                         [SamplingParams(max_tokens=16, n=2, stop=["stop"])], None, 1)
        reader = asyncio.create_task(consume(gen))
        assert adds(broker) == [(1, "cmpl-p-0-0"), (1, "cmpl-p-0-1")]
        broker.in_flight.fail("cmpl-p-0-1", 1, RequestFailedError(FULL, 429))
        while not broker.loads.room:
            await asyncio.sleep(0)
        assert aborts(broker) == [(1, ["cmpl-p-0-0"])]
        broker.in_flight.deliver(EngineCoreOutput("other", [9], finish_reason="length"))
        while len(adds(broker)) < 4:
            await asyncio.sleep(0)
        assert adds(broker)[2:] == [(1, "cmpl-p-0-0.1"), (1, "cmpl-p-0-1.1")]
        late = tiny_tokenizer.encode(" late", add_special_tokens=False)
        broker.in_flight.deliver(EngineCoreOutput("cmpl-p-0-0", late))  # the first attempt's
        stopped = tiny_tokenizer.encode(" go stop here", add_special_tokens=False)
        broker.in_flight.deliver(EngineCoreOutput("cmpl-p-0-0.1", stopped))
        assert aborts(broker)[1:] == [(1, ["cmpl-p-0-0.1"])]  # the stop string ended it
        broker.in_flight.deliver(EngineCoreOutput("cmpl-p-0-1.1", [40, 41],
                                                  finish_reason="length"))
        await asyncio.wait_for(reader, 5)
        choices = list(gen.choices.values())
        assert choices[0].token_ids == stopped and choices[0].text == " go "
        assert choices[1].token_ids == [40, 41]
        assert broker.in_flight.sinks == {} and len(aborts(broker)) == 2

    asyncio.run(scenario())


def test_waiters_wake_in_arrival_order_on_any_servers_finish(broker):
    async def scenario() -> None:
        room, woken = broker.loads.room, []

        async def wait(name: str, first: bool = False) -> None:
            if await room.wait(5, first):
                woken.append(name)

        async def until(count: int) -> None:
            while len(woken) < count:
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(wait(name)) for name in "abc"]
        while len(room) < 3:
            await asyncio.sleep(0)
        tasks.append(asyncio.create_task(wait("d", first=True)))  # beaten to a slot before
        while len(room) < 4:
            await asyncio.sleep(0)
        broker.in_flight.add("r", 0, lambda item: None)
        broker.in_flight.deliver(EngineCoreOutput("r", [1], finish_reason="length"))
        await until(1)
        load(broker, {0: 5, 1: 2})
        load(broker, {0: 3, 1: 2})  # two requests of another server's finished on dp0
        await until(3)
        load(broker, {0: 4, 1: 1})  # one more on dp1 (dp0's new one is not a finish)
        await asyncio.gather(*tasks)
        assert woken == ["d", "a", "b", "c"]

    asyncio.run(scenario())


def test_a_drain_and_the_removal_heard_together_end_a_shown_stream(broker, tiny_tokenizer):
    """A stream that has shown tokens on a leaving rank: when the drain's notice and the
    rank's removal both arrive before the stream reads either, the removal still ends it
    (the notice alone would keep it waiting on a rank that is gone)."""
    async def scenario() -> None:
        gen = Generation(broker, tiny_tokenizer, "cmpl-d", [[5, 6, 7]],
                         [SamplingParams(max_tokens=16)], None, 1, streamed=True)
        texts = gen.stream()
        broker.in_flight.deliver(EngineCoreOutput("cmpl-d-0-0", [40, 41]))
        assert (await anext(texts)).text
        broker.drain_rank(1)
        broker.remove_rank(1, "its rank was removed by a scale-down to 1")
        with pytest.raises(EngineDeadError, match="scale-down to 1"):
            await asyncio.wait_for(anext(texts), 5)

    asyncio.run(scenario())


def handed_off(broker: EngineClient, wire_id: str, first: list[int]) -> None:
    """The prefill rank dp0 samples `first` and hands the request off."""
    broker.in_flight.deliver(EngineCoreOutput(wire_id, first))
    broker.in_flight.deliver(EngineCoreOutput(wire_id, [], finish_reason=HANDED_OFF))


def decodes(broker: EngineClient) -> list[tuple[int, list[int]]]:
    return [(rank, msg.generated_token_ids) for rank, msg in broker.sent
            if isinstance(msg, p.AddRequest) and msg.generated_token_ids]


def test_a_decode_phase_every_rank_refused_waits_for_room_and_goes_on_alone(
        broker, tiny_tokenizer):
    """p1xd2: the decode ranks and the prefill rank standing in refuse the decode phase; it
    waits for a slot, then only the decode phase goes again (no second prefill, the same id),
    and the first token the client already has stays."""
    async def scenario() -> None:
        broker.pools = EnginePools(1)
        broker.in_flight.add("other", 2, lambda item: None)  # its finish will free a slot
        gen = Generation(broker, tiny_tokenizer, "cmpl-h", [[5, 6, 7]],
                         [SamplingParams(max_tokens=3)], None, None, streamed=True)
        texts = gen.stream()
        assert adds(broker) == [(0, "cmpl-h-0-0")]
        handed_off(broker, "cmpl-h-0-0", [40])
        assert (await anext(texts)).text  # the first token, from the prefill rank
        for _ in range(3):  # dp1 or dp2, the other, then dp0 standing in: all full
            rank = broker.in_flight.engine_of["cmpl-h-0-0"]
            broker.in_flight.fail("cmpl-h-0-0", rank, RequestFailedError(FULL, 429))
        assert sorted(rank for rank, _ in decodes(broker)) == [0, 1, 2]
        assert "cmpl-h-0-0" not in broker.in_flight.engine_of
        following = asyncio.create_task(anext(texts))
        while not broker.loads.room:  # it waits for room, holding nothing
            await asyncio.sleep(0)
        broker.in_flight.deliver(EngineCoreOutput("other", [9], finish_reason="length"))
        while len(decodes(broker)) < 4:
            await asyncio.sleep(0)
        rank, generated = decodes(broker)[3]  # the prompt is not sent again, nor its token
        assert rank in (1, 2) and generated == [40] and adds(broker)[-1] == (rank, "cmpl-h-0-0")
        broker.in_flight.deliver(EngineCoreOutput("cmpl-h-0-0", [41, 42],
                                                  finish_reason="length"))
        assert (await asyncio.wait_for(following, 5)).finished
        assert gen.choices["cmpl-h-0-0"].token_ids == [40, 41, 42]
        assert broker.in_flight.sinks == {}

    asyncio.run(scenario())


def test_a_decode_phase_refused_past_the_hold_is_a_429_that_says_when_to_retry(
        broker, tiny_tokenizer):
    async def scenario() -> None:
        broker.pools = EnginePools(1)
        broker.loads.drain.on_finished(100)  # a fast drain: a short wait for room
        gen = Generation(broker, tiny_tokenizer, "cmpl-q", [[5, 6, 7]],
                         [SamplingParams(max_tokens=3)], None, None)
        reader = asyncio.create_task(consume(gen))
        handed_off(broker, "cmpl-q-0-0", [40])
        for _ in range(3):
            rank = broker.in_flight.engine_of["cmpl-q-0-0"]
            broker.in_flight.fail("cmpl-q-0-0", rank, RequestFailedError(FULL, 429))
        with pytest.raises(RetryLaterError) as refused:
            await asyncio.wait_for(reader, 5)
        assert refused.value.status == 429 and refused.value.retry_after > 0
        assert "the decode phase" in refused.value.message
        assert len(adds(broker)) == 4 and broker.in_flight.sinks == {}
        assert len(broker.loads.room) == 0

    asyncio.run(scenario())

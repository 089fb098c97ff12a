"""The broker's view of a lockstep (expert-parallel) group: one rank's death takes its peers
down at once, so that a failover never lands on a peer that is about to die, and each rank
comes back with its own restarted incarnation. Torch-free: a real broker, no engines."""

import asyncio
import time

import pytest
import zmq

from parashift.serve.engine_client import EngineClient
from parashift.serve.engine_errors import EngineDeadError, EngineUnavailableError
from parashift.wire import protocol as p


def _broker(tmp_path, lockstep: bool) -> EngineClient:
    broker = EngineClient(0, f"ipc://{tmp_path}/requests", f"ipc://{tmp_path}/outputs", 3)
    for rank in range(3):
        broker.on_ready(p.EngineReady(rank, 256, 100, 1000 + rank, 16, lockstep),
                        str(rank).encode())
    return broker


def test_a_lockstep_death_takes_the_group_down_until_each_rank_is_back(tmp_path):
    async def scenario() -> None:
        broker = _broker(tmp_path, lockstep=True)
        try:
            engine = broker.ctx.socket(zmq.DEALER)  # dp0's end of the requests link
            engine.setsockopt(zmq.IDENTITY, b"0")
            engine.connect(f"ipc://{tmp_path}/requests")
            deadline = time.monotonic() + 10
            received: list = []
            while True:  # until the connection is up
                try:
                    broker.add_request("r0", [1, 2, 3], p.SamplingParams(), None, 0,
                                       received.append)
                    break
                except EngineUnavailableError:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.01)
            broker.mark_dead(1, "process exited with code -9", 1001)
            assert sorted(broker.ranks.dead()) == [0, 1, 2]
            assert "dp1 is down" in broker.ranks.dead()[0]
            assert [type(r) for r in received] == [EngineDeadError]  # dp0's request failed
            with pytest.raises(EngineUnavailableError):
                broker.pick_engine(exclude=1)
            # The old dp0's own death, heard late, changes nothing; the new dp0 serves.
            broker.on_ready(p.EngineReady(0, 256, 100, 2000, 16, True))
            broker.mark_dead(0, "gloo: connection closed", 1000)
            assert broker.alive_engines() == [0]
            assert broker.pick_engine(exclude=1) == 0
        finally:
            broker.ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_an_independent_ranks_death_is_its_own(tmp_path):
    async def scenario() -> None:
        broker = _broker(tmp_path, lockstep=False)
        try:
            broker.mark_dead(1, "process exited with code -9", 1001)
            assert sorted(broker.ranks.dead()) == [1]
            assert broker.alive_engines() == [0, 2]
        finally:
            broker.ctx.destroy(linger=0)

    asyncio.run(scenario())

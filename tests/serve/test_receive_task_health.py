"""If an API server's receive task stops all the same (a bug the guarded decodes did not
catch), /health turns red and names it, rather than the server hanging while saying ok."""

from __future__ import annotations

import asyncio
import time

import msgspec
import zmq

from parashift.serve.engine_client import EngineClient
from parashift.types.outputs import EngineCoreOutput, SchedulerStats
from parashift.wire import protocol as p


def test_a_stopped_receive_task_turns_health_red_naming_it(tmp_path, monkeypatch):
    async def scenario() -> None:
        client = EngineClient(0, f"ipc://{tmp_path}/requests", f"ipc://{tmp_path}/outputs", 1)
        client.on_ready(p.EngineReady(0, 256, 100, 1, 16), b"dp0")
        client.start()
        engine = client.ctx.socket(zmq.PUSH)
        try:
            assert client.health() == (True, "ok")
            client.sinks["r0"] = lambda out: None
            client.engine_of["r0"] = 0

            def bug(out: EngineCoreOutput) -> None:
                raise RuntimeError("a bug in delivery")

            monkeypatch.setattr(client, "_deliver", bug)
            engine.connect(f"ipc://{tmp_path}/outputs")
            await engine.send(p.encode(p.EngineOutputs(
                0, [EngineCoreOutput("r0", [1])], SchedulerStats(0, 1, 0.0))))
            deadline = time.monotonic() + 10
            while client.health()[0]:
                assert time.monotonic() < deadline, "the stopped task went unnoticed"
                await asyncio.sleep(0.01)
            ok, why = client.health()
            assert not ok and "receive task(s) outputs stopped" in why
        finally:
            engine.close(0)
            await client.close()

    asyncio.run(scenario())


def test_a_deeply_nested_frame_stops_no_receive_task(tmp_path):
    """A UtilityResult whose result nests 3,000 deep (the frame that once ended the outputs
    task: its result was typed Any), and such frames on the control and load links: dropped;
    the next real output is delivered and /health stays ok."""
    deep = b"\x91" * 3000 + b"\xc0"
    utility = b"\x94" + msgspec.msgpack.encode("UtilityResult") + b"\x00\x01" + deep
    death = b"\x94" + msgspec.msgpack.encode("EngineDead") + b"\x00" + deep + b"\x00"

    async def scenario() -> None:
        client = EngineClient(0, f"ipc://{tmp_path}/requests", f"ipc://{tmp_path}/outputs", 1,
                              coordinator_address=f"ipc://{tmp_path}/load")
        client.on_ready(p.EngineReady(0, 256, 100, 1, 16), b"dp0")
        client.start()
        engine = client.ctx.socket(zmq.PUSH)
        control = client.ctx.socket(zmq.DEALER)
        coordinator = client.ctx.socket(zmq.PUB)
        try:
            coordinator.bind(f"ipc://{tmp_path}/load")
            received: list[EngineCoreOutput] = []
            client.sinks["r0"] = received.append
            client.engine_of["r0"] = 0
            engine.connect(f"ipc://{tmp_path}/outputs")
            control.connect(f"ipc://{tmp_path}/requests")
            for _ in range(3):
                await engine.send(utility)
                await control.send(deep)
                await control.send(death)
            # A real message after the deep ones on each link: once it is taken, they were
            # read (each link keeps its order).
            await engine.send(p.encode(p.EngineOutputs(
                0, [EngineCoreOutput("r0", [1])], SchedulerStats(0, 1, 0.0))))
            await control.send(p.encode(p.EngineReady(0, 256, 100, 2, 16)))
            vector = p.encode(p.LoadVector(1, [p.EngineLoad(0, SchedulerStats(7, 0, 0.0))]))
            deadline = time.monotonic() + 10
            while not (received and client.ranks.ever_ready()[0].incarnation == 2
                       and 0 in client.loads.vector):
                assert time.monotonic() < deadline, client.health()
                await coordinator.send(deep)  # again until the subscription is in place
                await coordinator.send(vector)
                await asyncio.sleep(0.01)
            assert client.health() == (True, "ok")
        finally:
            for sock in (engine, control, coordinator):
                sock.close(0)
            await client.close()

    asyncio.run(scenario())

"""If an API server's receive task stops all the same (a bug the guarded decodes did not
catch), /health turns red and names it, rather than the server hanging while saying ok."""

from __future__ import annotations

import asyncio
import time

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

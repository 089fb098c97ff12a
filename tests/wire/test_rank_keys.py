"""Rank keys over CURVE: the head's processes accept only the keys the head minted (its own
and each rank's), and take what speaks for a rank only from that rank's key. Real sockets on
127.0.0.1 under a cluster secret: an API server's engine client, a real rank, another rank
that tries to pass for it, and a holder of the secret alone."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from parashift.serve.engine_client import EngineClient
from parashift.types.outputs import EngineCoreOutput, SchedulerStats
from parashift.types.sampling_params import SamplingParams
from parashift.wire import protocol as p
from parashift.wire.cluster_auth import HeadKeys, Role
from parashift.wire.sockets import routing_id, zmq_context

from . import handshakes

SECRET = "rank-keys-test-secret-0123456789"


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv("PARASHIFT_CLUSTER_SECRET", SECRET)


def _output(request_id: str, token: int) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [token])


async def _until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def test_only_a_ranks_key_speaks_for_it(secret):
    keys = HeadKeys.mint(2)

    async def scenario() -> None:
        client = EngineClient(0, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", 2, head_keys=keys)
        requests = client.requests.getsockopt(zmq.LAST_ENDPOINT).decode()
        outputs = client.outputs.getsockopt(zmq.LAST_ENDPOINT).decode()
        client.start()
        links = {name: zmq_context(role=Role(pair)) for name, pair in
                 (("dp0", keys.ranks[0]), ("dp1", keys.ranks[1]), ("head", keys.head))}
        member = zmq_context()  # holds the secret, and no key of the head's
        try:
            def dealer(ctx: zmq.Context, name: str) -> zmq.Socket:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IDENTITY, routing_id(name))
                sock.connect(requests)
                return sock

            def pusher(ctx: zmq.Context) -> zmq.Socket:
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(outputs)
                return sock

            # A holder of the secret alone completes no handshake with an API server.
            stranger = member.socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            monitor = stranger.get_monitor_socket()
            stranger.connect(requests)
            assert handshakes.refused(monitor), "a key the head never minted got in"

            dp0, dp1 = dealer(links["dp0"], "dp0"), dealer(links["dp1"], "dp1")
            dp1.send(p.encode(p.EngineReady(0, 256, 100, 7, 16)))  # dp1 passes for dp0
            dp1.send(p.encode(p.EngineReady(1, 256, 100, 8, 16)))
            await _until(lambda: 1 in client.ranks.ever_ready(), "dp1's own EngineReady")
            assert 0 not in client.ranks.ever_ready() and 0 not in client.routes
            dp0.send(p.encode(p.EngineReady(0, 256, 100, 9, 16)))
            await _until(lambda: 0 in client.ranks.ever_ready(), "dp0's EngineReady")
            assert client.ranks.ever_ready()[0].incarnation == 9

            received: dict[str, list] = {"r0": [], "r1": []}
            client.add_request("r0", [1, 2, 3], SamplingParams(), None, 0,
                               received["r0"].append)
            client.add_request("r1", [1, 2, 3], SamplingParams(), None, 1,
                               received["r1"].append)
            for engine, request_id in ((dp0, "r0"), (dp1, "r1")):  # each its own, in order
                assert engine.poll(10_000)
                assert p.decode(engine.recv(), p.ToEngine).request_id == request_id

            stats = SchedulerStats(0, 0, 0.0)
            forged, real = pusher(links["dp1"]), pusher(links["dp0"])
            forged.send(p.encode(p.EngineOutputs(0, [_output("r0", 66)], stats)))  # as dp0
            forged.send(p.encode(p.EngineOutputs(1, [_output("r0", 77)], stats)))  # not its
            forged.send(p.encode(p.RequestFailed(1, "r0", "forged")))
            forged.send(p.encode(p.EngineOutputs(1, [_output("r1", 11)], stats)))  # its own
            await _until(lambda: received["r1"], "dp1's output")  # after its forged frames
            assert received["r0"] == []
            real.send(p.encode(p.EngineOutputs(0, [_output("r0", 42)], stats)))
            await _until(lambda: received["r0"], "dp0's output")
            assert [o.new_token_ids for o in received["r0"]] == [[42]]

            # The launcher's word (a shutdown) counts from the head's key only.
            impostor = dealer(links["dp0"], "launcher")
            impostor.send(p.encode(p.Shutdown(1.0)))
            impostor.send(p.encode(p.EngineReady(0, 256, 100, 10, 16)))  # read after it
            await _until(lambda: client.ranks.ever_ready()[0].incarnation == 10,
                         "dp0's second EngineReady")
            assert not client.shutdown_requested.is_set()
            launcher = dealer(links["head"], "launcher")
            launcher.send(p.encode(p.Shutdown(1.0)))
            await asyncio.wait_for(client.shutdown_requested.wait(), 10)
        finally:
            for ctx in (*links.values(), member):
                ctx.destroy(linger=0)
            await client.close()

    asyncio.run(scenario())

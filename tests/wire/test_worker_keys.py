"""Worker keys over CURVE (Ray workers' step links): an engine's sockets to its workers admit
only the keys it minted for them, and each worker's command socket only that worker's. Real
sockets on 127.0.0.1 under a cluster secret: the engine's links (ray_executor.worker_links),
a worker, another worker at the first one's command socket, and a holder of the secret alone."""

from __future__ import annotations

import contextlib

import pytest
import zmq

from parashift.executor.ray_executor import worker_links
from parashift.wire import protocol as p
from parashift.wire import worker_protocol as wp
from parashift.wire.cluster_auth import Role, WorkerKeys
from parashift.wire.sockets import zmq_context

from . import handshakes

SECRET = "worker-keys-test-secret-0123456789"


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv("PARASHIFT_CLUSTER_SECRET", SECRET)


def endpoint(sock: zmq.Socket) -> str:
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def refused(ctx: zmq.Context, kind: int, address: str) -> zmq.Socket:
    """A socket of `ctx` connected to `address`, once its CURVE handshake has failed."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket()
    sock.connect(address)
    assert handshakes.refused(monitor), f"a peer got into {address}"
    sock.disable_monitor()  # its inproc name ends with the socket's descriptor: freed for reuse
    monitor.close(linger=0)
    return sock


def test_only_a_workers_key_takes_its_commands_and_sends_results(secret):
    keys = WorkerKeys.mint(2)
    ctx, results, commands = worker_links(keys, 2, "127.0.0.1")
    workers = [zmq_context(role=Role(pair)) for pair in keys.workers]
    member = zmq_context()  # holds the secret, and no worker's key
    try:
        # Neither a holder of the secret nor the other worker gets into worker 0's commands;
        # the secret alone does not get into the results either.
        # (each kept open: a socket collected would free its descriptor for the next one)
        strangers = [refused(member, zmq.PULL, endpoint(commands[0])),
                     refused(workers[1], zmq.PULL, endpoint(commands[0]))]
        injector = refused(member, zmq.PUSH, endpoint(results))
        assert not any(sock.closed for sock in strangers)
        with contextlib.suppress(zmq.Again):  # queued, never delivered
            injector.send(p.encode(wp.WorkerReply(0, "injected")), zmq.NOBLOCK)

        worker0 = workers[0].socket(zmq.PULL)
        worker0.setsockopt(zmq.LINGER, 0)
        worker0.connect(endpoint(commands[0]))
        reply = workers[0].socket(zmq.PUSH)
        reply.setsockopt(zmq.LINGER, 0)
        reply.connect(endpoint(results))
        calls = [wp.WorkerCall("kv_block_bytes", [i]) for i in range(20)]
        for call in calls:  # a PUSH deals to every peer it admitted: here, worker 0 alone
            commands[0].send(p.encode(call))
        received = []
        for _ in calls:
            assert worker0.poll(10_000)
            received.append(p.decode(worker0.recv(), wp.ToWorker))
        assert received == calls
        reply.send(p.encode(wp.WorkerReply(0, 4096)))
        assert results.poll(10_000)
        assert p.decode(results.recv(), wp.FromWorker) == wp.WorkerReply(0, 4096)
        # Worker 1 reaches its own commands and the results.
        worker1 = workers[1].socket(zmq.PULL)
        worker1.setsockopt(zmq.LINGER, 0)
        worker1.connect(endpoint(commands[1]))
        commands[1].send(p.encode(calls[0]))
        assert worker1.poll(10_000) and p.decode(worker1.recv(), wp.ToWorker) == calls[0]
    finally:
        for c in (*workers, member, ctx):
            c.destroy(linger=0)


def test_without_a_secret_the_links_are_plain(monkeypatch):
    monkeypatch.delenv("PARASHIFT_CLUSTER_SECRET", raising=False)
    ctx, results, commands = worker_links(None, 1, "127.0.0.1")
    try:
        assert not results.getsockopt(zmq.CURVE_SERVER)
        assert endpoint(commands[0]).startswith("tcp://127.0.0.1:")
    finally:
        ctx.destroy(linger=0)

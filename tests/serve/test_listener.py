"""serve/listener.py on a real socket, under uvloop and asyncio: at most max_connections are
handed to aiohttp at once; at the cap it stops accepting and the next client waits (in the
backlog, or parked unread when accepted in the same burst, at most MAX_PARKED of them, the
rest of a burst closed at once), then is served once a slot frees; stop() ends accepting at
any count and closes what is parked. Every wait is for an event."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from parashift.serve import listener as listener_module
from parashift.serve.listener import CappedListener

REQUEST = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"
CLOSING = b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


def run(loop_kind: str, main) -> None:
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
    else:
        asyncio.run(main())


async def serving(cap: int) -> tuple[web.AppRunner, CappedListener, int]:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0), backlog=64)
    assert runner.server is not None
    listener = CappedListener(runner.server, sock, cap)
    await listener.start()
    return runner, listener, sock.getsockname()[1]


async def answered(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    await asyncio.wait_for(reader.readexactly(2), 30)  # the body: "ok"
    return head.split(b"\r\n", 1)[0]


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_the_next_client_waits_for_a_free_slot(loop_kind):
    async def main() -> None:
        runner, listener, port = await serving(2)
        held = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(REQUEST)
            assert await answered(reader) == b"HTTP/1.1 200 OK"
            held.append((reader, writer))
        while listener.accepting.is_set():  # the pause comes right after the accept
            await asyncio.sleep(0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # the backlog's
        writer.write(REQUEST)
        waiting = asyncio.ensure_future(answered(reader))
        held[0][1].write(REQUEST)  # a round trip after the waiting client's request
        assert await answered(held[0][0]) == b"HTTP/1.1 200 OK"
        assert not waiting.done() and listener.num_open == 2
        held.pop(0)[1].close()
        assert await waiting == b"HTTP/1.1 200 OK"
        assert listener.most_open == 2
        for _, w in [*held, (reader, writer)]:
            w.close()
        await listener.accepting.wait()  # below the cap: accepting again
        listener.stop()
        await runner.cleanup()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_a_burst_past_the_cap_is_served_in_turn(loop_kind):
    async def main() -> None:
        runner, listener, port = await serving(2)
        clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
        for _, writer in clients:
            writer.write(CLOSING)  # each frees its slot once answered
        heads = await asyncio.gather(*(answered(reader) for reader, _ in clients))
        assert heads == [b"HTTP/1.1 200 OK"] * 10
        assert listener.most_open == 2
        for _, writer in clients:
            writer.close()
        listener.stop()
        await runner.cleanup()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_stop_ends_accepting_and_lets_open_connections_drain(loop_kind):
    async def main() -> None:
        runner, listener, port = await serving(1)
        clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        clients[0][1].write(REQUEST)
        assert await answered(clients[0][0]) == b"HTTP/1.1 200 OK"
        listener.stop()
        assert not listener.accepting.is_set() and not listener._parked
        clients[0][1].write(REQUEST)  # the open one still serves
        assert await answered(clients[0][0]) == b"HTTP/1.1 200 OK"
        for _, writer in clients:
            writer.close()
        await runner.cleanup()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_stop_below_the_cap_ends_accepting(loop_kind):
    """Below the cap too: a client that connects after stop() waits in the backlog (for
    another API server), and one accepted in the same burst is closed, not parked."""
    async def main() -> None:
        runner, listener, port = await serving(5)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        assert await answered(reader) == b"HTTP/1.1 200 OK"
        listener.stop()
        assert not listener.accepting.is_set() and listener._listening is None
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", port)
        late_writer.write(REQUEST)
        writer.write(REQUEST)  # a round trip after the late client's request
        assert await answered(reader) == b"HTTP/1.1 200 OK"
        assert listener.num_open == 1 and not listener._parked and not late_reader.at_eof()

        class Transport:
            closed = False

            def close(self) -> None:
                self.closed = True

        transport = Transport()
        listener._accept().connection_made(transport)  # type: ignore[arg-type]
        assert transport.closed and not listener._parked
        for w in (writer, late_writer):
            w.close()
        await runner.cleanup()

    run(loop_kind, main)


def test_a_burst_parks_at_most_max_parked(monkeypatch):
    """One burst of accepts past the cap parks MAX_PARKED connections and closes the rest at
    once, so that parked ones never take the descriptors the server needs for itself. On
    asyncio, which accepts every pending connection in one go (uvloop here accepted one per
    wake-up, its burst not reproducible)."""
    monkeypatch.setattr(listener_module, "MAX_PARKED", 2)

    async def main() -> None:
        runner, listener, port = await serving(1)
        # Connected before the loop runs again: all accepted in one go.
        socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(5)]
        while len(listener._parked) < 2 or listener.accepting.is_set():
            await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        for sock in socks[3:]:  # closed at once, before any request
            assert await loop.run_in_executor(None, sock.recv, 1) == b""
        assert listener.num_open == 1 and len(listener._parked) == 2
        clients = [await asyncio.open_connection(sock=sock) for sock in socks[:3]]
        for _, writer in clients:
            writer.write(CLOSING)
        heads = await asyncio.gather(*(answered(reader) for reader, _ in clients))
        assert heads == [b"HTTP/1.1 200 OK"] * 3 and listener.most_open == 1
        for sock in socks:
            sock.close()
        listener.stop()
        await runner.cleanup()

    asyncio.run(main())


def test_a_failed_resume_is_tried_again(monkeypatch):
    """No descriptor left for the socket's duplicate when a slot frees: accepting resumes on
    a later try, though no other connection is left to close."""
    monkeypatch.setattr(listener_module, "RETRY_S", 0.01)

    class FailingOnce:
        def __init__(self, sock: socket.socket):
            self.sock, self.failed = sock, False

        def dup(self) -> socket.socket:
            if not self.failed:
                self.failed = True
                raise OSError(24, "Too many open files")
            return self.sock.dup()

    async def main() -> None:
        runner, listener, port = await serving(1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        assert await answered(reader) == b"HTTP/1.1 200 OK"
        while listener.accepting.is_set():
            await asyncio.sleep(0)
        listener.sock = FailingOnce(listener.sock)  # type: ignore[assignment]
        writer.close()
        await asyncio.wait_for(listener.accepting.wait(), 30)
        assert listener.sock.failed
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(CLOSING)
        assert await answered(reader) == b"HTTP/1.1 200 OK"
        writer.close()
        listener.stop()
        await runner.cleanup()

    asyncio.run(main())


def test_the_descriptor_limit_is_raised_to_what_the_cap_needs(monkeypatch):
    import resource

    limits = {"now": (1024, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda kind: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda kind, value: limits.update(now=value))
    assert listener_module.allow_descriptors(1024) == 1024 + listener_module.OWN_DESCRIPTORS
    assert limits["now"] == (1024 + listener_module.OWN_DESCRIPTORS, 4096)
    limits["now"] = (1024, 1500)  # the hard limit caps it (and a warning says so)
    assert listener_module.allow_descriptors(4096) == 1500
    limits["now"] = (65536, 65536)  # enough already: unchanged
    assert listener_module.allow_descriptors(1024) == 65536

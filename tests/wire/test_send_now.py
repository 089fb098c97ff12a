"""wire/sockets.py send_now: a send on an asyncio socket that raises at once and never leaves
that socket's waiting receive asleep. An API server's request socket (serve/engine_client.py)
takes its engines' and launcher's messages while it sends requests: a send past the asyncio
socket's back took the wake-up of a message that had come in, and a scale's answer then sat
unread for minutes. (With that plain send in place of send_now, the first test's receive
gets nothing within its 5 s.)"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from parashift.wire.sockets import send_now


async def receive_after_a_send() -> list[bytes]:
    """A message comes in while a receive waits; something other than the receive takes the
    socket's wake-up (a plain look at it, as any send past the asyncio socket does); then
    the socket sends. What the waiting receive gets."""
    actx, ctx = zmq.asyncio.Context(), zmq.Context()
    try:
        router = actx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.IDENTITY, b"peer")
        peer.connect(f"tcp://127.0.0.1:{port}")
        peer.send(b"hello")  # the router learns the peer's route
        assert await router.recv_multipart() == [b"peer", b"hello"]
        receiving = asyncio.ensure_future(router.recv_multipart())
        await asyncio.sleep(0)  # it waits on the socket's descriptor now
        peer.send(b"news")
        assert zmq.Socket.shadow(router.underlying).poll(5000) == zmq.POLLIN  # took the edge
        send_now(router, [b"peer", b"reply"])
        assert peer.recv() == b"reply"
        return await asyncio.wait_for(receiving, 5)
    finally:
        actx.destroy(linger=0)
        ctx.destroy(linger=0)


def test_a_receive_waiting_while_the_socket_sends_gets_its_message():
    assert asyncio.run(receive_after_a_send()) == [b"peer", b"news"]


def test_a_send_that_fails_raises_at_once():
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            router = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.LINGER, 0)
            router.bind_to_random_port("tcp://127.0.0.1")
            with pytest.raises(zmq.ZMQError) as raised:
                send_now(router, [b"nobody", b"x"])
            assert raised.value.errno == zmq.EHOSTUNREACH
        finally:
            ctx.destroy(linger=0)

    asyncio.run(main())

"""The sockets of the launch: ZMQ contexts (frame cap, CURVE where the cluster secret is
held), subscribers, and TCP listeners bound before they are handed to the process that serves
them."""

from __future__ import annotations

import secrets
import socket

import zmq
import zmq.asyncio

from parashift import env
from parashift.wire.cluster_auth import ClusterKeys, Role, secured_context

# A frame larger than this is refused by ZMQ itself on every socket (no message of ours comes
# near it): a peer cannot make a process allocate without bound.
MAX_FRAME_BYTES = 256 << 20


def zmq_context(asyncio: bool = False, role: Role | None = None) -> zmq.Context:
    """A ZMQ context whose sockets all refuse frames over MAX_FRAME_BYTES and, where this
    process holds the cluster secret, bind and connect over tcp:// only with CURVE (as `role`
    says, where the process is more than a holder of the secret)."""
    secret = env.cluster_secret()
    if secret is not None:
        ctx = secured_context(ClusterKeys.from_secret(secret, role), asyncio)
    else:
        ctx = zmq.asyncio.Context() if asyncio else zmq.Context()
    ctx.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # the default of every socket it makes
    return ctx


def subscriber(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A SUB socket on everything published at `address`, dropped unsent at close."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def send_now(sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    """Sends `frames` on an asyncio socket at once (NOBLOCK) and raises what the send raised,
    where awaiting would park the error in a future nobody awaits. The send goes through the
    asyncio socket itself, never a plain socket shadowing it: ZMQ wakes a waiting receive by an
    edge on one file descriptor, and a send the asyncio socket does not see can consume that
    edge, leaving the receive asleep, with messages queued, until another peer sends."""
    sent = sock.send_multipart(frames, flags=zmq.NOBLOCK)  # done at once: nothing waits
    sent.result()


def routing_id(name: str) -> bytes:
    """A connecting socket's identity on a ROUTER: its name and 64 random bits, new in every
    process. No ROUTER takes over an identity in use (no ROUTER_HANDOVER), and no other peer
    can guess this one, so no peer can take another's route."""
    return f"{name}-{secrets.token_hex(8)}".encode()


def tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def listen_tcp(host: str, port: int, backlog: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket that child processes can inherit (OSError if it cannot bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def bind(sock: zmq.Socket, address: str, bound: dict[str, socket.socket] | None = None
         ) -> None:
    """Bind `sock` at `address`, on the listening socket a launcher bound there for us when
    it handed one over (zmq takes the file descriptor over)."""
    listener = (bound or {}).get(address)
    if listener is not None:
        sock.setsockopt(zmq.USE_FD, listener.detach())
    sock.bind(address)

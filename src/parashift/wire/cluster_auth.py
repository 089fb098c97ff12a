"""Authenticated cluster links: ZMQ CURVE on every tcp:// socket, keyed by the cluster secret.

Both key pairs (the binding side's and the connecting side's) are derived from the secret
(HMAC-SHA256 with a label, as Curve25519 secret keys). A connecting socket must know the
binding side's public key to open its CURVE handshake, and that key is never sent: a peer
without the secret cannot complete the handshake, so it reads nothing (no address, no
config) and writes nothing. Every frame after the handshake is encrypted and authenticated.
ipc:// sockets (one node, in a 0700 folder) stay plain.

The secret reaches each process through its environment (PARASHIFT_CLUSTER_SECRET: children
inherit it; Ray actors get it as an argument): every ZMQ context a process makes
(`wire/sockets.py` zmq_context) then secures the sockets it binds and connects over tcp."""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils import z85

MIN_SECRET_CHARS = 16


def read_secret_file(path: str) -> str:
    """The secret in `path`: a file of this user's that no one else can read (mode 0600 or
    stricter) and that is no link. ValueError naming the file otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"--cluster-secret-file {path}: {e.strerror}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"--cluster-secret-file {path}: mode {st.st_mode & 0o777:o}, "
                             f"owner uid {st.st_uid}; it must be this user's and mode 0600 "
                             "(chmod 600)")
        secret = f.read().strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"--cluster-secret-file {path}: the secret must have at least "
                         f"{MIN_SECRET_CHARS} characters")
    return secret


@dataclass(frozen=True)
class ClusterKeys:
    server_public: bytes  # z85, 40 bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str) -> ClusterKeys:
        def pair(label: bytes) -> tuple[bytes, bytes]:
            private = z85.encode(hmac.new(secret.encode(), label, hashlib.sha256).digest())
            return zmq.curve_public(private), private

        server_public, server_secret = pair(b"parashift-curve-server")
        client_public, client_secret = pair(b"parashift-curve-client")
        return cls(server_public, server_secret, client_public, client_secret)


class _Curve:
    """bind/connect of a socket made by a secured context: CURVE on tcp:// addresses. The
    keys are a class attribute (`secured_context` makes the class): pyzmq reads unknown
    instance attributes as socket options."""

    cluster_keys: ClusterKeys

    def bind(self, addr: str):
        if addr.startswith("tcp://"):
            self.curve_server = True
            self.curve_secretkey = self.cluster_keys.server_secret
        return super().bind(addr)

    def connect(self, addr: str):
        if addr.startswith("tcp://"):
            self.curve_serverkey = self.cluster_keys.server_public
            self.curve_publickey = self.cluster_keys.client_public
            self.curve_secretkey = self.cluster_keys.client_secret
        return super().connect(addr)


def secured_context(keys: ClusterKeys, asyncio: bool = False) -> zmq.Context:
    """A context whose sockets run CURVE with `keys` on every tcp:// bind and connect."""
    socket_base = zmq.asyncio.Socket if asyncio else zmq.Socket
    context_base = zmq.asyncio.Context if asyncio else zmq.Context
    socket_class = type("CurveSocket", (_Curve, socket_base), {"cluster_keys": keys})
    return type("CurveContext", (context_base,), {"_socket_class": socket_class})()


def handshake_failed(monitor: zmq.Socket) -> bool:
    """Whether a socket monitor (`sock.get_monitor_socket()`) reported a failed handshake:
    the peer holds another secret (or none), or is no parashift process."""
    from zmq.utils.monitor import recv_monitor_message

    failed = False
    while monitor.poll(0):
        event = recv_monitor_message(monitor)["event"]
        failed |= event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                            zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    return failed

"""Authenticated cluster links: ZMQ CURVE on every tcp:// socket, keyed by the cluster secret.

The binding side's key pair is derived from the secret (HMAC-SHA256 with a label, as a
Curve25519 secret key). A connecting socket must know the binding side's public key to open
its CURVE handshake, and that key is never sent: a peer without the secret cannot complete the
handshake, so it reads nothing (no address, no config) and writes nothing. Every frame after
the handshake is encrypted and authenticated. ipc:// sockets (one node, in a 0700 folder) stay
plain.

Holding the secret proves membership of the cluster, not which rank a process is. So the head
mints a key pair per rank for each launch (`HeadKeys`) and hands rank r's to the one engine
whose Hello it answered for r, inside the encrypted handshake. The head's processes accept on
their tcp sockets only the keys they know (ZAP, `_serve_zap`), and name each link's key: a
message that speaks for rank r is taken only from a link authenticated with rank r's key
(`principal`). Another node holding the secret can thus neither take a running rank's route nor
speak for it. An engine whose workers are Ray actors mints a key per worker likewise
(`WorkerKeys`): its tcp sockets to them admit only those keys, and each worker's command
socket only that worker's (a ZAP domain per socket), so a holder of the secret can neither take
step commands nor inject results.

The secret reaches each process through its environment (PARASHIFT_CLUSTER_SECRET: children
inherit it; Ray actors get it as an argument): every ZMQ context a process makes
(`wire/sockets.py` zmq_context) then secures the sockets it binds and connects over tcp."""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import zmq
import zmq.asyncio
from zmq.utils import z85

from parashift.wire.protocol import log_dropped

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


CLUSTER = "cluster"  # a holder of the secret, no more: a headless node, an engine before its Hello
HEAD = "head"  # the head's launcher, API servers and coordinator


def rank_principal(rank: int) -> str:
    return f"dp{rank}"


@dataclass(frozen=True)
class CurvePair:
    public: bytes  # z85, 40 bytes
    secret: bytes

    @classmethod
    def fresh(cls) -> CurvePair:
        return cls(*zmq.curve_keypair())

    @classmethod
    def derived(cls, secret: str, label: bytes) -> CurvePair:
        private = z85.encode(hmac.new(secret.encode(), label, hashlib.sha256).digest())
        return cls(zmq.curve_public(private), private)


@dataclass(frozen=True)
class Role:
    """Who a process is on the cluster's links where it is more than a holder of the secret:
    the key it connects with and, for the sockets it binds, the only keys it accepts (public
    key, z85 -> principal)."""

    key: CurvePair
    peers: Mapping[bytes, str] | None = None
    cluster: bool = False  # also accept the secret's own client key (as CLUSTER)
    # ZAP domain (a binding socket's zmq.ZAP_DOMAIN) -> the only principals it admits
    domains: Mapping[str, frozenset[str]] | None = None


@dataclass(frozen=True)
class HeadKeys:
    """Minted by the head launcher once per launch and given to its own processes only."""

    head: CurvePair
    ranks: tuple[CurvePair, ...]

    @classmethod
    def mint(cls, num_engines: int) -> HeadKeys:
        return cls(CurvePair.fresh(), tuple(CurvePair.fresh() for _ in range(num_engines)))

    def role(self, cluster: bool = False) -> Role:
        """The head's processes' role. `cluster`: where headless nodes, and engines before
        their rank's key, connect (the handshake, the coordinator)."""
        peers = {self.head.public: HEAD}
        peers.update((pair.public, rank_principal(r)) for r, pair in enumerate(self.ranks))
        return Role(self.head, peers, cluster)


def worker_principal(index: int) -> str:
    return f"worker{index}"


@dataclass(frozen=True)
class WorkerKeys:
    """Minted by an engine for its workers (Ray actors, on tcp links), given to each worker
    alone: worker i's command socket binds in ZAP domain `worker_principal(i)`."""

    workers: tuple[CurvePair, ...]

    @classmethod
    def mint(cls, num_workers: int) -> WorkerKeys:
        return cls(tuple(CurvePair.fresh() for _ in range(num_workers)))

    def role(self) -> Role:
        """The engine's, for the sockets it binds for its workers."""
        names = [worker_principal(i) for i in range(len(self.workers))]
        return Role(CurvePair.fresh(),  # it connects nowhere with it
                    {pair.public: name for pair, name in zip(self.workers, names, strict=True)},
                    domains={name: frozenset({name}) for name in names})


@dataclass(frozen=True)
class ClusterKeys:
    server: CurvePair  # of every binding socket
    client: CurvePair  # this process's, when it connects
    peers: Mapping[bytes, str] | None = field(default=None, compare=False)
    domains: Mapping[str, frozenset[str]] | None = field(default=None, compare=False)

    @classmethod
    def from_secret(cls, secret: str, role: Role | None = None) -> ClusterKeys:
        keys = cls(CurvePair.derived(secret, b"parashift-curve-server"),
                   CurvePair.derived(secret, b"parashift-curve-client"))
        if role is None:
            return keys
        peers = role.peers
        if peers is not None and role.cluster:
            peers = {**peers, keys.client.public: CLUSTER}
        return replace(keys, client=role.key, peers=peers, domains=role.domains)


class _Curve:
    """bind/connect of a socket made by a secured context: CURVE on tcp:// addresses. The
    keys are a class attribute (`secured_context` makes the class): pyzmq reads unknown
    instance attributes as socket options."""

    cluster_keys: ClusterKeys

    def bind(self, addr: str):
        if addr.startswith("tcp://"):
            self.curve_server = True
            self.curve_secretkey = self.cluster_keys.server.secret
        return super().bind(addr)

    def connect(self, addr: str):
        if addr.startswith("tcp://"):
            self.curve_serverkey = self.cluster_keys.server.public
            self.curve_publickey = self.cluster_keys.client.public
            self.curve_secretkey = self.cluster_keys.client.secret
        return super().connect(addr)


def secured_context(keys: ClusterKeys, asyncio: bool = False) -> zmq.Context:
    """A context whose sockets run CURVE with `keys` on every tcp:// bind and connect and,
    where `keys.peers` is given, accept only those keys."""
    socket_base = zmq.asyncio.Socket if asyncio else zmq.Socket
    context_base = zmq.asyncio.Context if asyncio else zmq.Context
    socket_class = type("CurveSocket", (_Curve, socket_base), {"cluster_keys": keys})
    ctx = type("CurveContext", (context_base,), {"_socket_class": socket_class})()
    if keys.peers is not None:
        names = {z85.decode(public): name.encode() for public, name in keys.peers.items()}
        domains = {domain.encode(): {name.encode() for name in admitted}
                   for domain, admitted in (keys.domains or {}).items()}
        zap = zmq.Context.shadow(ctx.underlying).socket(zmq.REP)  # the same context, in sync
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind("inproc://zeromq.zap.01")  # before any socket of the context handshakes
        threading.Thread(target=_serve_zap, args=(zap, names, domains), name="parashift-zap",
                         daemon=True).start()
    return ctx


def _serve_zap(sock: zmq.Socket, names: dict[bytes, bytes],
               domains: dict[bytes, set[bytes]]) -> None:
    """ZMQ's authentication handler (RFC 27) for one context: a CURVE client key is let in
    under its principal's name (on a socket of a listed domain, only a principal it admits),
    or refused; it ends when the context is terminated."""
    try:
        while True:
            request = sock.recv_multipart()
            # version, request id, domain, address, identity, mechanism, credentials...
            request_id = request[1] if len(request) > 1 else b""
            mechanism = request[5] if len(request) > 5 else b""
            name = (names.get(request[6]) if mechanism == b"CURVE" and len(request) == 7
                    else None)
            admitted = domains.get(request[2]) if len(request) > 2 else None
            if name is not None and admitted is not None and name not in admitted:
                name = None
            if mechanism == b"NULL":  # a plain link (ipc in the 0700 folder): no principal
                name = b""
            status = (b"200", b"OK") if name is not None else (b"400", b"unknown key")
            sock.send_multipart([b"1.0", request_id, *status, name or b"", b""])
    except zmq.ContextTerminated:
        pass
    finally:
        sock.close()


def principal(frame: zmq.Frame) -> str | None:
    """The principal of the link `frame` came in on (HEAD, CLUSTER, a rank's); None on a plain
    link (ipc in the launch's 0700 folder, or --insecure-cluster), where every local process
    is this user's."""
    try:
        return frame.get("User-Id") or None
    except zmq.ZMQError:
        return None


def speaks_for(frame: zmq.Frame, name: str, link: str) -> bool:
    """Whether a message in `frame` may speak as `name`: it came on a plain link, or on one
    authenticated as `name`. A refusal is logged (`log_dropped`)."""
    who = principal(frame)
    if who is None or who == name:
        return True
    log_dropped(link, f"a message as {name} from a link of {who}")
    return False


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

"""The internal wire of a running dp2 server, fuzzed: for 30 s, random bytes, multi-part junk
and msgpack that looks like our messages (a real tag, fields of every type, always too many to
be one) go to every socket the processes bind (handshake, the API server's request and output
sockets, the coordinator's load socket). No process dies, /health stays 200, and requests are
still answered."""

from __future__ import annotations

import contextlib
import random
import time

import msgspec
import psutil
import pytest
import zmq

from parashift.wire import protocol as p

from .conftest import TINY_ARGS, running_server

pytestmark = pytest.mark.slow

TAGS = sorted(name for name, kind in vars(p).items()
              if isinstance(kind, type) and issubclass(kind, p._Msg) and kind is not p._Msg)
FUZZ_SECONDS = 30.0


def junk(rng: random.Random) -> list[bytes]:
    kind = rng.randrange(4)
    if kind == 0:
        return [rng.randbytes(rng.randrange(1, 300))]
    if kind == 1:  # a real tag, then more fields than any message has: never a valid message
        values = [rng.randrange(-2**40, 2**40), "x" * rng.randrange(20), None, 1.5, [1, "a"],
                  {"k": [None]}, b"\x00\xff", True, -1]
        return [msgspec.msgpack.encode([rng.choice(TAGS),
                                        *(rng.choice(values) for _ in range(40))])]
    if kind == 2:
        return [msgspec.msgpack.encode(rng.choice([{"a": [1, 2]}, [None, None], "text", 12345,
                                                   [rng.choice(TAGS), {"x": 1}] * 3]))]
    return [rng.randbytes(rng.randrange(0, 16)) for _ in range(rng.randrange(2, 5))]


def bound_ipc_paths(server) -> dict[str, str]:
    """Every ipc socket the server's processes bind, by the name of its file."""
    root = psutil.Process(server.proc.pid)
    paths = {}
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            for conn in proc.net_connections(kind="unix"):
                if isinstance(conn.laddr, str) and "/parashift-" in conn.laddr:
                    paths[conn.laddr.rsplit("/", 1)[1]] = conn.laddr
    return paths


def peer_type(name: str) -> int | None:
    if name == "handshake" or name.endswith("-requests"):
        return zmq.DEALER  # to a ROUTER
    if name.endswith("-outputs") or name == "coordinator-load":
        return zmq.PUSH  # to a PULL
    return None  # a PUB (publishes only)


def test_fuzzed_internal_sockets_kill_nothing(tiny_llama):
    with running_server(tiny_llama, *TINY_ARGS, "--strategy", "dp2") as server:
        tree = [psutil.Process(server.proc.pid),
                *psutil.Process(server.proc.pid).children(recursive=True)]
        targets = {name: path for name, path in bound_ipc_paths(server).items()
                   if peer_type(name) is not None}
        assert {"handshake", "api0-requests", "api0-outputs", "coordinator-load"} <= set(
            targets), targets
        ctx = zmq.Context()
        rng = random.Random(0)
        sent = 0
        try:
            sockets = []
            for name, path in targets.items():
                sock = ctx.socket(peer_type(name))
                sock.setsockopt(zmq.LINGER, 0)
                if peer_type(name) == zmq.DEALER:
                    sock.setsockopt(zmq.IDENTITY, b"fuzz")  # no engine's identity
                sock.connect(f"ipc://{path}")
                sockets.append(sock)
            deadline = time.monotonic() + FUZZ_SECONDS
            while time.monotonic() < deadline:
                for sock in sockets:
                    with contextlib.suppress(zmq.Again):
                        sock.send_multipart(junk(rng), zmq.NOBLOCK)
                        sent += 1
                time.sleep(0.001)
        finally:
            ctx.destroy(linger=0)
        assert sent > 1000
        dead = [proc for proc in tree
                if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE]
        assert not dead, server.output()[-6000:]
        status, body = server.get_json("/health")
        assert status == 200, body
        for rank in (0, 1):
            status, raw = server.request("POST", "/v1/completions",
                                         {"prompt": "hello", "max_tokens": 4,
                                          "ignore_eos": True},
                                         headers={"X-data-parallel-rank": str(rank)})
            assert status == 200, raw
        assert "dropped a malformed frame" in server.output()

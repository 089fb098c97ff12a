"""The internal wire of a running dp2 server, fuzzed: for 30 s, random bytes, multi-part junk
and msgpack that looks like our messages (a real tag, fields of every type, always too many to
be one) go to every socket the processes bind (handshake, the API server's request and output
sockets, the coordinator's load socket); and frames nested 3,000 deep (past the interpreter's
recursion limit), alone and as each field of each message. No process dies, /health stays
200, and requests are still answered."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator

import msgspec
import psutil
import pytest
import zmq

from parashift.wire import protocol as p

from .servers import TINY_ARGS, running_server

pytestmark = pytest.mark.slow

TAGS = sorted(name for name, kind in vars(p).items()
              if isinstance(kind, type) and issubclass(kind, p._Msg) and kind is not p._Msg)
FUZZ_ROUNDS = 4000  # a junk frame to every internal socket each round


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


DEPTH = 3000
DEEP = [b"\x91" * DEPTH + b"\xc0", b"\x81\xa1k" * DEPTH + b"\xc0"]  # [[[...]]], {"k": {...}}


def deep_frames() -> list[bytes]:
    """Each deep value alone, and as each field of each message after fields of 0 (which
    most fields take: a UtilityResult's result is reached)."""
    frames = list(DEEP)
    for tag in TAGS:
        for position in range(1, 8):
            frames += [bytes([0x90 + position + 1]) + msgspec.msgpack.encode(tag)
                       + b"\x00" * (position - 1) + deep for deep in DEEP]
    return frames


@pytest.fixture(scope="module")
def dp2_server(tiny_llama):
    with running_server(tiny_llama, *TINY_ARGS, "--strategy", "dp2") as server:
        yield server


@contextlib.contextmanager
def peers(server) -> Iterator[list[zmq.Socket]]:
    """A peer on every socket the server's processes bind (but the publishers)."""
    targets = {name: path for name, path in bound_ipc_paths(server).items()
               if peer_type(name) is not None}
    assert {"handshake", "api0-requests", "api0-outputs", "coordinator-load"} <= set(
        targets), targets
    ctx = zmq.Context()
    try:
        sockets = []
        for name, path in targets.items():
            sock = ctx.socket(peer_type(name))
            sock.setsockopt(zmq.LINGER, 0)
            if peer_type(name) == zmq.DEALER:
                sock.setsockopt(zmq.IDENTITY, b"fuzz")  # no engine's identity
            sock.connect(f"ipc://{path}")
            sockets.append(sock)
        yield sockets
    finally:
        ctx.destroy(linger=0)


def assert_all_serving(server, tree: list[psutil.Process]) -> None:
    dead = [proc for proc in tree
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE]
    assert not dead, server.output()[-6000:]
    status, body = server.get_json("/health")
    assert status == 200, body
    for rank in (0, 1):
        status, raw = server.request("POST", "/v1/completions",
                                     {"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                                     headers={"X-data-parallel-rank": str(rank)})
        assert status == 200, raw


def process_tree(server) -> list[psutil.Process]:
    return [psutil.Process(server.proc.pid),
            *psutil.Process(server.proc.pid).children(recursive=True)]


# The links of the handshake, api0-requests, api0-outputs and coordinator-load sockets, as
# their readers name them in the log.
LINKS = ("handshake", "control", "outputs", "load")


def test_deeply_nested_frames_kill_nothing(dp2_server):
    """Runs first on its server (no frame dropped before): each reader logs its 1st and
    1,001st dropped frame, so 1,001 frames in all (the deep ones, then junk) on each socket
    are all read once the 1,001st is logged."""
    assert "dropped" not in dp2_server.output()
    tree = process_tree(dp2_server)
    frames = deep_frames()
    frames += [b"\xff"] * (1001 - len(frames))
    with peers(dp2_server) as sockets:
        for sock in sockets:
            for frame in frames:
                sock.send(frame)
        for link in LINKS:
            dp2_server.wait_line(rf"dropped a malformed frame on the {link} link \(1001 so far")
    assert_all_serving(dp2_server, tree)


def test_fuzzed_internal_sockets_kill_nothing(dp2_server):
    tree = process_tree(dp2_server)
    rng = random.Random(0)
    sent = 0
    with peers(dp2_server) as sockets:
        for _ in range(FUZZ_ROUNDS):
            for sock in sockets:
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart(junk(rng), zmq.NOBLOCK)
                    sent += 1
            time.sleep(0.001)
    assert sent > 1000
    assert_all_serving(dp2_server, tree)
    assert "dropped a malformed frame" in dp2_server.output()

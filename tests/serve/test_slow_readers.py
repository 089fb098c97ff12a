"""Clients that stop reading: 50 streams whose clients never read a byte (raw sockets with a
small receive buffer) fill the socket buffers; each request's outputs then wait in its own
samples, not in a queue of messages, so the API server's memory stays bounded; after
--stream-idle-timeout each client is dropped, its request aborted and its KV blocks freed; a
client that reads is served meanwhile. A whole (non-streamed) body that is not read is dropped
the same way; a request body that stops arriving is a 408, and its connection closed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import psutil
import pytest
from aiohttp import web

from parashift.serve import respond, sse

from .servers import LONG_ARGS, LONG_MAX_MODEL_LEN, running_server

IDLE_TIMEOUT_S = 2
NUM_STALLED = 50
# Many tokens, each with its top-20 logprobs (~1.5 kB an event): the stream outruns the
# socket buffers within ~100 tokens, long before the request could end.
STALLED = {"prompt": "hi", "max_tokens": LONG_MAX_MODEL_LEN - 100, "temperature": 0,
           "ignore_eos": True, "logprobs": 20, "stream": True}
RSS_GROWTH_LIMIT = 200 << 20  # each holds its own samples, nothing more: ~60 MiB measured


@pytest.fixture(scope="module")
def server(tiny_llama_long):
    with running_server(tiny_llama_long, *LONG_ARGS, "--stream-idle-timeout",
                        str(IDLE_TIMEOUT_S)) as s:
        yield s


def api_server(server) -> psutil.Process:
    for proc in server.current_tree():
        with contextlib.suppress(psutil.Error):
            if "parashift-api-0" in proc.name() or "parashift-api-0" in " ".join(
                    proc.cmdline()):
                return proc
    raise AssertionError("no parashift-api-0 process")


def stalled_stream(port: int, request: dict = STALLED) -> socket.socket:
    """A request whose client never reads its answer."""
    body = json.dumps(request).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body)
    return sock


def wait_until(condition, what: str, timeout: float = 120.0, on_poll=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        if on_poll is not None:
            on_poll()
        time.sleep(0.05)


def count(server, name: str, labels: str) -> float:
    return server.metric(name, labels) or 0.0


def test_clients_that_never_read_are_dropped_and_their_requests_freed(server):
    engine = 'engine="dp0"'
    idle_before = count(server, "parashift_requests_total", 'status="idle"')
    left_before = count(server, "parashift_http_responses_total", 'code="499"')
    proc = api_server(server)
    rss_before = proc.memory_info().rss
    peak = [rss_before]

    def sample_rss() -> None:
        peak[0] = max(peak[0], proc.memory_info().rss)

    port = int(server.url.rsplit(":", 1)[1])
    socks = [stalled_stream(port) for _ in range(NUM_STALLED)]
    try:
        wait_until(lambda: server.metric("parashift_num_requests_running", engine)
                   == NUM_STALLED, "the stalled streams never all ran", on_poll=sample_rss)
        # A client that reads is served while the others are stuck.
        status, raw = server.request("POST", "/v1/completions", {
            "prompt": "x", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 4
        wait_until(lambda: count(server, "parashift_requests_total", 'status="idle"')
                   == idle_before + NUM_STALLED, "the stalled clients were never dropped",
                   on_poll=sample_rss)
        wait_until(lambda: server.metric("parashift_num_requests_running", engine) == 0
                   and server.metric("parashift_kv_cache_usage_ratio", engine) == 0,
                   "the dropped clients' requests kept running", timeout=30)
    finally:
        for sock in socks:
            sock.close()
    assert count(server, "parashift_http_responses_total", 'code="499"') == \
        left_before + NUM_STALLED
    assert peak[0] - rss_before < RSS_GROWTH_LIMIT, (rss_before, peak[0])
    status, health = server.get_json("/health")
    assert status == 200 and health["status"] == "ok"


def test_a_request_not_streamed_has_a_limit_by_default():
    """--non-stream-timeout (600 s) unless --request-timeout, which bounds streams too, is
    shorter; the 504 names the flag that applied."""
    assert sse.non_stream_limit(None, 600.0) == (600.0, "--non-stream-timeout")
    assert sse.non_stream_limit(4.0, 600.0) == (4.0, "--request-timeout")
    assert sse.non_stream_limit(900.0, 600.0) == (600.0, "--non-stream-timeout")
    error = sse.timed_out(600.0, "--non-stream-timeout")
    assert error.status == 504 and "--non-stream-timeout (600 s)" in error.message


def test_a_whole_body_not_read_is_dropped(server):
    """A non-streamed answer (~1 MB: 16 x 250 tokens with their top-20 logprobs) to a client
    that reads nothing: written by the API server in paced pieces, the client dropped after
    --stream-idle-timeout (counted idle, 499), not holding its connection and body for ever."""
    idle_before = count(server, "parashift_requests_total", 'status="idle"')
    left_before = count(server, "parashift_http_responses_total", 'code="499"')
    request = {**STALLED, "max_tokens": 250, "n": 16, "stream": False}
    sock = stalled_stream(int(server.url.rsplit(":", 1)[1]), request)
    try:
        wait_until(lambda: count(server, "parashift_requests_total", 'status="idle"')
                   == idle_before + 1, "the client that did not read was never dropped")
        assert count(server, "parashift_http_responses_total", 'code="499"') == left_before + 1
        received = b""
        sock.settimeout(30)
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):  # what was in the buffers, then the end
                received += chunk
        head, _, body = received.partition(b"\r\n\r\n")  # a reset may discard it all
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                assert len(body) < int(line.split(b":")[1])  # cut short: aborted
    finally:
        sock.close()


def test_a_request_body_that_stops_arriving_is_a_408(server):
    """Headers, then part of the body, then nothing: a 408 after --stream-idle-timeout, and
    the connection closed (here at once: the client ends its side, which ends aiohttp's
    lingering read of the rest)."""
    sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])),
                                    timeout=30)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                     b'{"prompt": "hi", ')
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.1 408"), received
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(4096):
            pass  # the rest of the 408's body, then the server's close
    finally:
        sock.close()
    status, health = server.get_json("/health")
    assert status == 200 and health["status"] == "ok"


def test_a_client_that_pipelines_and_reads_nothing_is_dropped():
    """Any route's answer is written within the idle timeout (serve/respond.py
    paced_answers): a client that pipelines requests for 8 MiB of answers and reads none
    fills the buffers (the kernel's send buffer grows to 4 MiB), and its connection is then
    aborted instead of held for ever. On a small aiohttp server of its own."""
    async def main() -> None:
        async def big(request: web.Request) -> web.Response:
            return web.Response(body=b"x" * (256 << 10))

        app = web.Application(middlewares=[respond.paced_answers(0.5)])
        app.router.add_get("/", big)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", runner.addresses[0][1]))
        sock.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n" * 32)
        assert runner.server is not None

        async def dropped() -> None:
            while not runner.server.connections:  # accepted
                await asyncio.sleep(0.01)
            while runner.server.connections:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(dropped(), 30)
        sock.close()
        await runner.cleanup()

    asyncio.run(main())

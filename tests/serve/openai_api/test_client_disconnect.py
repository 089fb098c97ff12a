"""A client that goes away while its request runs on the package's server (conftest.py):
after reading a few chunks, without reading, or while waiting for a whole response; its
request is aborted and its KV blocks are freed. test_async_serving.py runs it against its
server too."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest

from ..servers import LONG_MAX_MODEL_LEN
from .conftest import MODEL


@pytest.mark.parametrize("mode", ["stream", "stream-unread", "json"])
def test_disconnect_frees_the_request(server, mode):
    """The client closes its connection while its request runs: after reading a few chunks,
    without reading (the server is stuck writing), or while waiting for a whole response."""
    running = ("parashift_num_requests_running", 'engine="dp0"')
    kv_usage = ("parashift_kv_cache_usage_ratio", 'engine="dp0"')
    disconnected = ("parashift_requests_total", 'status="disconnected"')
    before = server.metric(*disconnected) or 0.0
    # ~8000 tokens take the tiny model ~20 s: only an abort frees the engine sooner.
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": LONG_MAX_MODEL_LEN - 100,
                       "temperature": 0, "ignore_eos": True,
                       "stream": mode != "json"}).encode()
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if mode == "stream-unread":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    try:
        sock.connect(("127.0.0.1", port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)
        if mode == "stream":
            received = b""
            while received.count(b"data: ") < 5:
                data = sock.recv(65536)
                assert data, "the server closed the stream early"
                received += data
            assert received.startswith(b"HTTP/1.1 200")
        elif mode == "stream-unread":  # tokens have come, and stay unread in the buffer
            while b"data: " not in (data := sock.recv(65536, socket.MSG_PEEK)):
                assert data, "the server closed the stream early"
                time.sleep(0.02)
            assert data.startswith(b"HTTP/1.1 200")
        # Well into generation: the request has filled its first KV block and taken another
        # (a prompt of a few tokens fills one block of 16 after some 14 generated tokens).
        deadline = time.monotonic() + 30
        while server.metric(*running) != 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        first_block = server.metric(*kv_usage)
        assert first_block > 0
        while server.metric(*kv_usage) <= first_block:
            assert time.monotonic() < deadline, "the request generates nothing"
            time.sleep(0.02)
        assert server.metric(*running) == 1
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the handler's counter may land after the engine's
        if (server.metric(*running) == 0 and server.metric(*kv_usage) == 0
                and server.metric(*disconnected) == before + 1):
            break
        time.sleep(0.05)
    assert server.metric(*running) == 0, "the request kept running after the client left"
    assert server.metric(*kv_usage) == 0, "the request's KV blocks were not freed"
    assert server.metric(*disconnected) == before + 1
    status, health = server.get_json("/health")
    assert status == 200 and health["status"] == "ok"

"""What a plain loopback server (no key, no admin flag, --max-connections 3) admits: at most 3
open connections, the next waiting in the backlog until one closes; only loopback Host names
(DNS rebinding: bad_input/test_http_guards.py serves one more with --allowed-hosts); no admin
routes (404), and none in its OpenAPI document."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import psutil
import pytest

from .servers import TINY_ARGS, running_server

MAX_CONNECTIONS = 3
ADMIN_ROUTES = [("POST", "/reset_prefix_cache"), ("POST", "/sleep?level=1"),
                ("POST", "/wake_up"), ("GET", "/is_sleeping")]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with running_server(tiny_llama, *TINY_ARGS, "--max-connections", str(MAX_CONNECTIONS)) as s:
        yield s


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def held_connections(server) -> int:
    """Connections to the HTTP port that a process of the server holds (accepted); one that
    waits in the listen backlog belongs to no process yet."""
    port = _port(server)
    count = 0
    for proc in server.current_tree():
        with contextlib.suppress(psutil.Error):
            count += sum(1 for c in proc.net_connections(kind="tcp")
                         if c.laddr and c.laddr.port == port
                         and c.status == psutil.CONN_ESTABLISHED)
    return count


def wait_held(server, expected: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while held_connections(server) != expected:
        assert time.monotonic() < deadline, (held_connections(server), expected)
        time.sleep(0.02)


def open_served(server) -> socket.socket:
    """A keep-alive connection that has been answered once (so: accepted, and still open)."""
    sock = socket.create_connection(("127.0.0.1", _port(server)), timeout=30)
    send_health(sock)
    assert read_status(sock) == 200
    return sock


def send_health(sock: socket.socket) -> None:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")


def read_status(sock: socket.socket) -> int:
    """The status of one response with a Content-Length body, read whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "the server closed the connection"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(4096)
    return int(head.split()[1])


def test_at_most_max_connections_are_open_and_the_next_waits_for_a_free_one(server):
    wait_held(server, 0)  # start-up's own /health call has closed
    held = [open_served(server) for _ in range(MAX_CONNECTIONS)]
    waiting = socket.create_connection(("127.0.0.1", _port(server)), timeout=30)
    try:
        send_health(waiting)
        # A round trip on a held connection after the waiting one sent its request: the
        # server is at work, and holds no more than its cap.
        send_health(held[0])
        assert read_status(held[0]) == 200
        assert held_connections(server) == MAX_CONNECTIONS
        held.pop(0).close()
        assert read_status(waiting) == 200  # it is let in once one closes
        wait_held(server, MAX_CONNECTIONS)
    finally:
        for sock in [*held, waiting]:
            sock.close()
    wait_held(server, 0)
    assert server.request("GET", "/health")[0] == 200


def test_a_host_name_other_than_loopback_is_refused(server):
    port = _port(server)
    for host in ("rebind.example", f"rebind.example:{port}"):
        status, raw = server.request("GET", "/v1/models", headers={"Host": host})
        assert status == 421, raw
        assert json.loads(raw)["error"]["code"] == "host_not_allowed"
    assert server.request("GET", "/v1/models", headers={"Host": f"localhost:{port}"})[0] == 200


def test_admin_routes_are_absent_without_an_admin_key_or_flag(server):
    for method, path in ADMIN_ROUTES:
        status, raw = server.request(method, path, headers={"Content-Type": ""})
        assert status == 404, (path, raw)
    status, doc = server.get_json("/openapi.json")
    assert status == 200 and "/sleep" not in doc["paths"] and "/v1/models" in doc["paths"]

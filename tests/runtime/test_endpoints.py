"""Where a deployment's sockets live (Endpoints) and the shared HTTP listener, on real sockets:
one node's ipc files sit in a folder only this user can enter, gone after `remove`; tcp ports
are held bound on the given host alone, inheritable by the process they are handed to, and
released by `remove`; API servers share one HTTP port, and a port taken otherwise is a
StartupError naming the flags. (Addresses and the hand-over: tests/serve/test_topology_args.)"""

from __future__ import annotations

import os
import socket
import stat

import pytest
import zmq

from parashift.runtime.endpoints import Endpoints, bind_listener
from parashift.runtime.node import StartupError
from parashift.wire.sockets import bind


def test_local_endpoints_live_in_a_private_folder_that_remove_deletes():
    local = Endpoints.local(2)
    try:
        folder = local.ipc_dir
        assert folder is not None and stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        every = [local.handshake, *local.requests, *local.outputs, local.coordinator_load,
                 local.coordinator_publish]
        assert all(a.startswith(f"ipc://{folder}/") for a in every)
        assert local.bound == {} and local.handed(*every) == {}  # nothing to hand over
        ctx = zmq.Context()
        try:
            router = ctx.socket(zmq.ROUTER)
            bind(router, local.requests[1], local.handed(local.requests[1]))
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(local.requests[1])
            dealer.send(b"to API server 1")
            assert router.poll(10_000) and router.recv_multipart()[1] == b"to API server 1"
        finally:
            ctx.destroy(linger=0)
    finally:
        local.remove()
    assert not os.path.exists(folder)
    local.remove()  # twice is harmless (the launcher's cleanup may run again)


def test_tcp_endpoints_hold_their_ports_until_remove():
    tcp = Endpoints.tcp("127.0.0.1", 0, 1)
    try:
        # The handshake port is the launcher's own to bind (0: any); the rest are held now.
        assert tcp.handshake == "tcp://127.0.0.1:0" and tcp.handshake not in tcp.bound
        assert tcp.handed(tcp.handshake, tcp.outputs[0]) == {
            tcp.outputs[0]: tcp.bound[tcp.outputs[0]]}
        socks = list(tcp.bound.values())
        assert len(socks) == 4
        for sock in socks:
            assert sock.getsockname()[0] == "127.0.0.1"
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            assert sock.get_inheritable()  # the child it is handed to gets the descriptor
        ports = [sock.getsockname()[1] for sock in socks]
        socket.create_connection(("127.0.0.1", ports[0]), timeout=10).close()  # held: accepted
    finally:
        tcp.remove()
    assert all(sock.fileno() == -1 for sock in socks)
    for port in ports:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_tcp_endpoints_on_an_ipv6_host_bracket_it():
    tcp = Endpoints.tcp("::1", 0, 1)
    try:
        assert tcp.handshake == "tcp://[::1]:0"
        for address, sock in tcp.bound.items():
            assert sock.family == socket.AF_INET6
            assert address == f"tcp://[::1]:{sock.getsockname()[1]}"
    finally:
        tcp.remove()


def test_api_servers_share_the_http_port_and_a_taken_port_names_the_flags():
    first = bind_listener("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        second = bind_listener("127.0.0.1", port)  # another API server process's, SO_REUSEPORT
        second.close()
    finally:
        first.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=f"--host 127.0.0.1 --port {port}: cannot listen"):
            bind_listener("127.0.0.1", port)

"""Where every socket of one deployment lives. One node: ipc files in a private temp folder.
Several nodes (or Ray): tcp on the head's address, the handshake on --data-parallel-rpc-port
(the one address other nodes are told; 0 for any) and the rest on ports the kernel picks:
this launcher binds each of them now and hands the bound socket to the process that serves
it (zmq's USE_FD), so no other program can take a port between its choice and its use.
Engines learn the addresses through the handshake."""

from __future__ import annotations

import contextlib
import shutil
import socket
import tempfile
from dataclasses import dataclass, field

from parashift.runtime.node import StartupError
from parashift.wire.sockets import listen_tcp, tcp_url


@dataclass
class Endpoints:
    handshake: str
    requests: list[str]  # per API server: its ROUTER, every engine's DEALER connects
    outputs: list[str]  # per API server: its PULL, every engine's PUSH connects
    coordinator_load: str  # coordinator PULL <- engines
    coordinator_publish: str  # coordinator PUB -> API servers, headless launchers
    ipc_dir: str | None = field(default=None, repr=False)
    bound: dict[str, socket.socket] = field(default_factory=dict, repr=False)  # tcp only

    @classmethod
    def local(cls, api_server_count: int) -> Endpoints:
        d = tempfile.mkdtemp(prefix="parashift-")
        return cls(f"ipc://{d}/handshake",
                   [f"ipc://{d}/api{i}-requests" for i in range(api_server_count)],
                   [f"ipc://{d}/api{i}-outputs" for i in range(api_server_count)],
                   f"ipc://{d}/coordinator-load", f"ipc://{d}/coordinator-pub", d)

    @classmethod
    def tcp(cls, host: str, rpc_port: int, api_server_count: int) -> Endpoints:
        """`rpc_port` 0: the launcher binds its handshake on any port (and sets `handshake`)."""
        bound: dict[str, socket.socket] = {}
        try:
            for _ in range(2 * api_server_count + 2):
                sock = listen_tcp(host, 0, 256)
                bound[tcp_url(host, sock.getsockname()[1])] = sock
        except BaseException as e:
            for sock in bound.values():
                sock.close()
            if isinstance(e, OSError):
                raise ValueError(f"--data-parallel-address {host}: cannot bind there "
                                 f"({e.strerror})") from e
            raise
        urls = list(bound)
        return cls(tcp_url(host, rpc_port), urls[:api_server_count],
                   urls[api_server_count:-2], urls[-2], urls[-1], bound=bound)

    def expert_store(self, incarnation: int) -> str:
        """Where incarnation `incarnation` of the expert group's store binds: the launch's
        folder on one node, a port the kernel picks on the head's address otherwise."""
        if self.ipc_dir is not None:
            return f"ipc://{self.ipc_dir}/expert-store-{incarnation}"
        return f"{self.handshake.rpartition(':')[0]}:0"

    def handed(self, *addresses: str) -> dict[str, socket.socket]:
        """The bound sockets of `addresses`, for the process that serves them."""
        return {a: self.bound[a] for a in addresses if a in self.bound}

    def remove(self) -> None:
        for sock in self.bound.values():
            with contextlib.suppress(OSError):
                sock.close()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP socket, shared by every API server process (SO_REUSEPORT)."""
    try:
        return listen_tcp(host, port, 2048, reuse_port=True)
    except OSError as e:
        raise StartupError(f"--host {host} --port {port}: cannot listen there ({e.strerror})"
                           ) from e

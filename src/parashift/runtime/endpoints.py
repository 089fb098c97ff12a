"""Where every socket of one deployment lives. One node: ipc files in a private temp folder.
Several nodes: tcp on the head's --data-parallel-address, the handshake on
--data-parallel-rpc-port (the one address other nodes are told) and free ports for the rest;
engines learn those through the handshake."""

from __future__ import annotations

import shutil
import socket
import tempfile
from dataclasses import dataclass, field


@dataclass
class Endpoints:
    handshake: str
    requests: list[str]  # per API server: its ROUTER, every engine's DEALER connects
    outputs: list[str]  # per API server: its PULL, every engine's PUSH connects
    coordinator_load: str  # coordinator PULL <- engines
    coordinator_publish: str  # coordinator PUB -> API servers, headless launchers
    ipc_dir: str | None = field(default=None, repr=False)

    @classmethod
    def local(cls, api_server_count: int) -> Endpoints:
        d = tempfile.mkdtemp(prefix="parashift-")
        return cls(f"ipc://{d}/handshake",
                   [f"ipc://{d}/api{i}-requests" for i in range(api_server_count)],
                   [f"ipc://{d}/api{i}-outputs" for i in range(api_server_count)],
                   f"ipc://{d}/coordinator-load", f"ipc://{d}/coordinator-pub", d)

    @classmethod
    def tcp(cls, host: str, rpc_port: int, api_server_count: int) -> Endpoints:
        ports = free_ports(host, 2 * api_server_count + 2, exclude={rpc_port})
        return cls(tcp_url(host, rpc_port),
                   [tcp_url(host, port) for port in ports[:api_server_count]],
                   [tcp_url(host, port) for port in ports[api_server_count:-2]],
                   tcp_url(host, ports[-2]), tcp_url(host, ports[-1]))

    def remove(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def free_ports(host: str, count: int, exclude: set[int] = frozenset()) -> list[int]:
    """Ports the kernel says are free now; all held open until every one is chosen, so the
    list has no duplicates. (Another program could still take one before we bind it; the
    bind error then names the address.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket(family, socket.SOCK_STREAM)
            held.append(s)
            try:
                s.bind((host, 0))
            except OSError as e:
                raise ValueError(f"--data-parallel-address {host}: cannot bind there "
                                 f"({e.strerror})") from e
            port = s.getsockname()[1]
            if port not in exclude:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports

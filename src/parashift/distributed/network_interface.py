"""Which network interface holds an address: gloo binds its pairs to an interface named by
GLOO_SOCKET_IFNAME, and otherwise to whatever the host name resolves to, which may be a
routable address on a machine whose links were meant to stay on loopback or one network."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(address: str) -> str:
    """The name of this machine's interface that holds `address` (an IPv4 or IPv6 literal);
    ValueError naming the address if none does."""
    ip = ipaddress.ip_address(address.strip("[]"))
    for _, name in socket.if_nameindex():
        if ip in _addresses(name, ip.version):
            return name
    raise ValueError(f"no network interface of this machine holds {address}")


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (a literal or a name): the one its peers
    there reach it at. Loopback for a loopback host. (A UDP socket's connect sends nothing.)"""
    ip = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    if ip.is_loopback:
        return str(ip)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((str(ip), 9))
        return sock.getsockname()[0]


def _addresses(name: str, version: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    if version == 6:
        try:
            with open("/proc/net/if_inet6") as f:  # address, index, prefix, scope, flags, name
                rows = [line.split() for line in f]
        except OSError:
            return set()
        return {ipaddress.IPv6Address(int(row[0], 16)) for row in rows
                if len(row) == 6 and row[5] == name}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                              struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return set()
    return {ipaddress.IPv4Address(raw[20:24])}

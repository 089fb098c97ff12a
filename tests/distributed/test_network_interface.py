"""gloo binds the interface named by GLOO_SOCKET_IFNAME: the worker names the one that holds
the address it must stay on (loopback on one node), found among this machine's interfaces."""

from __future__ import annotations

import socket

import pytest

from parashift.distributed.network_interface import interface_of


def test_the_loopback_address_is_on_the_loopback_interface():
    name = interface_of("127.0.0.1")
    assert name in dict((n, i) for i, n in socket.if_nameindex())
    assert interface_of("[127.0.0.1]") == name


def test_an_address_no_interface_holds_is_refused_naming_it():
    with pytest.raises(ValueError, match="203.0.113.254"):  # TEST-NET-3: on no interface
        interface_of("203.0.113.254")
    with pytest.raises(ValueError):
        interface_of("not-an-address")

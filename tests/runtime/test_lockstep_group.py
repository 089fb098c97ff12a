"""The launcher's view of an expert-parallel group (LockstepGroup), with the real store it
hosts: one death breaks the whole group once (the peers the launcher then stops do not count
again), the restarted group meets at a new store while the old address takes no one, and it
serves again only when every engine of the new incarnation is ready."""

from __future__ import annotations

import datetime
import logging
import socket
import time

import psutil
import pytest
import zmq

from parashift.distributed.group_store import GroupStoreClient
from parashift.runtime.lockstep_group import LockstepGroup


def host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def store_client(address: str) -> GroupStoreClient:
    return GroupStoreClient(address, None, datetime.timedelta(seconds=30))


def listening_ips(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def open_group(ctx, num_engines: int) -> LockstepGroup:
    group = LockstepGroup(num_engines)
    group.open(ctx, lambda incarnation: "tcp://127.0.0.1:0")
    return group


def test_a_group_hosts_its_store_on_its_host_alone(ctx, tmp_path):
    group = open_group(ctx, 2)
    try:
        assert (group.incarnation, group.broken) == (0, False)
        assert group.address.startswith("tcp://127.0.0.1:")
        assert listening_ips(host_port(group.address)[1]) == {"127.0.0.1"}
        client = store_client(group.address)  # what an engine does to join
        client.set("joined", "dp1")
        assert group.store.data["joined"] == b"dp1" and client.get("joined") == b"dp1"
        client.close()
    finally:
        group.close()
    # One node: in the launch's folder.
    local = LockstepGroup(2)
    local.open(ctx, lambda incarnation: f"ipc://{tmp_path}/expert-store-{incarnation}")
    try:
        assert local.address == f"ipc://{tmp_path}/expert-store-0"
        client = store_client(local.address)
        assert client.add("count", 2) == 2 and client.add("count", 3) == 5
        client.close()
    finally:
        local.close()


def test_one_death_breaks_the_group_once_and_moves_it_to_a_new_store(ctx, caplog):
    group = open_group(ctx, 2)
    try:
        first = group.address
        client = store_client(first)
        client.set("incarnation", "0")
        client.close()
        with caplog.at_level(logging.ERROR, logger="parashift.runtime.lockstep_group"):
            assert group.on_death(1) is True  # the launcher must stop the others
            assert group.on_death(0) is False  # one it stopped: the group is broken already
        assert [r.getMessage() for r in caplog.records] == [
            "engine dp1 of the expert-parallel group died: stopping the group"]
        assert (group.incarnation, group.broken) == (1, True)
        assert group.address != first
        # An engine of the old incarnation finds nobody at the old address (once ZMQ's I/O
        # thread has closed the listener, which it does after the socket's close returns)...
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(host_port(first), timeout=10).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, "the old store still listens"
            time.sleep(0.05)
        # ...and the new store starts empty.
        client = store_client(group.address)
        assert client.check(["incarnation"]) is False
        client.set("incarnation", "1")
        assert group.store.data["incarnation"] == b"1"
        client.close()
    finally:
        group.close()


def test_the_group_serves_again_once_every_engine_of_the_new_incarnation_is_ready(ctx):
    group = open_group(ctx, 3)
    try:
        for rank in range(3):  # the first start: nothing was broken
            group.on_ready(rank, 100 + rank)
        assert not group.broken and group.pids == {0: 100, 1: 101, 2: 102}
        assert group.on_death(2)
        group.on_ready(2, 202)  # the restarted rank; the others' READYs were of the old one
        assert group.broken
        for rank in (0, 0):  # twice the same rank is still one engine
            group.on_ready(rank, 200)
            assert group.broken
        group.on_ready(1, 201)
        assert (group.broken, group.incarnation) == (False, 1)
        address = group.address
        assert group.on_death(0)  # the next death breaks it again, for a new store
        assert (group.broken, group.incarnation) == (True, 2) and group.address != address
    finally:
        group.close()

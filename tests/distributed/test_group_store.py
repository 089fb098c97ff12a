"""The expert group's rendezvous store (distributed/group_store.py): a torch Store whose calls
travel over ZMQ to the launcher's server. Its operations mean what torch's TCPStore's do (gloo
meets over it in test_communicator.py); what is over a bound is refused with an error that
names it; junk is dropped and the server goes on; under the cluster secret only a rank's key
is answered: a peer without the secret never completes a handshake, one with the secret but
no rank's key is answered nothing."""

from __future__ import annotations

import concurrent.futures
import datetime
import time

import pytest
import torch.distributed as dist
import zmq

from parashift.distributed import group_store
from parashift.distributed.group_store import GroupStoreClient, GroupStoreServer
from parashift.wire import protocol as p
from parashift.wire.cluster_auth import HeadKeys
from parashift.wire.sockets import zmq_context
from parashift.wire.store_protocol import StoreCall

SECRET = "expert-store-secret-0123456789abcdef"


@pytest.fixture
def server():
    ctx = zmq.Context()
    store = GroupStoreServer(ctx, "tcp://127.0.0.1:0")
    store.start()
    yield store
    store.stop()
    ctx.destroy(linger=0)


def client(address: str, key=None, seconds: float = 30) -> GroupStoreClient:
    return GroupStoreClient(address, key, datetime.timedelta(seconds=seconds))


def dropped(what: str) -> int:
    return p._num_dropped.get(("expert-store", what), 0)


def wait_dropped(what: str, before: int) -> None:
    deadline = time.monotonic() + 30
    while dropped(what) <= before:
        assert time.monotonic() < deadline, f"no {what} dropped"
        time.sleep(0.01)


def test_the_operations_mean_what_torchs_store_means(server):
    a, b = client(server.address), client(server.address)
    try:
        a.set("k", b"v1")
        assert b.get("k") == b"v1" and b.check(["k"]) and not b.check(["k", "missing"])
        assert a.add("n", 5) == 5 and b.add("n", -2) == 3 and a.get("n") == b"3"
        assert a.compare_set("k", b"v1", b"v2") == b"v2" and b.get("k") == b"v2"
        assert a.compare_set("k", b"other", b"v3") == b"v2"  # unchanged: the current value
        assert a.compare_set("new", b"", b"first") == b"first"
        assert a.compare_set("absent", b"x", b"y") == b"x" and not a.check(["absent"])
        assert a.num_keys() == 3
        assert a.delete_key("k") is True and a.delete_key("k") is False
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(b.get, "later")  # answered once it is set
            deadline = time.monotonic() + 30
            while not server.waiting:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            a.set("later", "now")
            assert waiting.result(timeout=30) == b"now"
        a.wait(["later", "new"])
        with pytest.raises(dist.DistStoreError, match="holds no number"):
            a.add("new", 1)
        # A prefix store over it, as each tp coordinate's group uses it.
        prefixed = dist.PrefixStore("ep-tp0", a)
        prefixed.set("x", b"1")
        assert b.get("ep-tp0/x") == b"1"
    finally:
        a.close()
        b.close()


def test_what_is_over_a_bound_is_refused_and_names_it(server, monkeypatch):
    c = client(server.address)
    try:
        with pytest.raises(dist.DistStoreError, match="a key over 1024 bytes"):
            c.set("k" * 1025, b"v")
        with pytest.raises(dist.DistStoreError, match="a value over 1048576 bytes"):
            c.set("k", b"v" * ((1 << 20) + 1))
        monkeypatch.setattr(group_store, "MAX_KEYS", 2)
        c.set("a", b"1")
        c.set("b", b"2")
        with pytest.raises(dist.DistStoreError, match="holds 2 keys already"):
            c.set("c", b"3")
        c.set("a", b"replaced")  # a key it holds may change
        monkeypatch.setattr(group_store, "MAX_HELD_BYTES", 32)
        with pytest.raises(dist.DistStoreError, match="would hold over 32 bytes"):
            c.set("b", b"x" * 40)
        assert c.get("b") == b"2"  # unchanged
        with pytest.raises(dist.DistStoreError, match="timed out waiting for never"):
            c._call("get", ["never"], timeout_s=0.2)
    finally:
        c.close()


def test_junk_is_dropped_and_the_server_goes_on(server):
    ctx = zmq.Context()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.address)
        before = dropped("a malformed frame")
        raw.send(b"\x93garbage")
        raw.send_multipart([b"two", b"frames"])
        wait_dropped("a malformed frame", before)
        raw.send(p.encode(StoreCall(7, "format_disk", ["k"])))
        answer = p.decode(raw.recv(), group_store.StoreAnswer)
        assert answer.call_id == 7 and "unknown store operation" in answer.error
        c = client(server.address)
        c.set("k", b"v")
        assert c.get("k") == b"v"
        c.close()
    finally:
        ctx.destroy(linger=0)


def test_under_the_secret_only_a_ranks_key_is_answered(monkeypatch):
    monkeypatch.setenv("PARASHIFT_CLUSTER_SECRET", SECRET)
    keys = HeadKeys.mint(2)
    head = zmq_context(role=keys.role(cluster=True))  # the launcher's, as in a launch
    server = GroupStoreServer(head, "tcp://127.0.0.1:0")
    server.start()
    plain, member = zmq.Context(), zmq_context()
    try:
        stranger = plain.socket(zmq.DEALER)  # no secret: no handshake completes
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(server.address)
        try:
            stranger.send(p.encode(StoreCall(1, "num_keys", [])), zmq.NOBLOCK)
        except zmq.Again:
            pass  # (no peer ever completes: nothing queues)
        before = dropped("a frame from cluster")
        holder = member.socket(zmq.DEALER)  # the secret, no rank's key
        holder.setsockopt(zmq.LINGER, 0)
        holder.connect(server.address)
        holder.send(p.encode(StoreCall(2, "set", ["k"], value=b"evil")))
        wait_dropped("a frame from cluster", before)
        rank = client(server.address, (keys.ranks[1].public, keys.ranks[1].secret))
        assert rank.check(["k"]) is False and rank.num_keys() == 0  # nothing was set
        rank.set("k", b"good")
        assert rank.get("k") == b"good"
        rank.close()
        assert not holder.poll(0) and not stranger.poll(0)
    finally:
        server.stop()
        plain.destroy(linger=0)
        member.destroy(linger=0)
        head.destroy(linger=0)

"""Cluster links under the cluster secret (ZMQ CURVE): peers with the secret talk; a peer with
another secret, or none, completes no handshake, so it reads nothing and writes nothing; ipc
sockets stay plain. The secret file is checked."""

from __future__ import annotations

import os

import pytest
import zmq

from parashift.wire.cluster_auth import (
    ClusterKeys,
    read_secret_file,
    secured_context,
)

from . import handshakes

SECRET = "a-cluster-secret-0123456789"


def context(secret: str | None) -> zmq.Context:
    return secured_context(ClusterKeys.from_secret(secret)) if secret else zmq.Context()


def test_keys_are_a_function_of_the_secret():
    a, b = ClusterKeys.from_secret(SECRET), ClusterKeys.from_secret(SECRET)
    assert a == b and a != ClusterKeys.from_secret(SECRET + "x")
    assert a.server.public != a.client.public and len(a.server.secret) == 40


def test_peers_with_the_secret_talk_and_others_get_nothing():
    head = context(SECRET)
    try:
        router = head.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        assert router.getsockopt(zmq.CURVE_SERVER)
        for secret in ("another-secret-0123456789", None):
            stranger_ctx = context(secret)
            stranger = stranger_ctx.socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            monitor = stranger.get_monitor_socket()
            stranger.connect(f"tcp://127.0.0.1:{port}")
            stranger.send(b"Hello from a stranger")
            assert handshakes.refused(monitor), secret  # the handshake failed: nothing went through
            assert not router.poll(0)
            stranger_ctx.destroy(linger=0)
        friend_ctx = context(SECRET)
        friend = friend_ctx.socket(zmq.DEALER)
        friend.setsockopt(zmq.LINGER, 0)
        friend.connect(f"tcp://127.0.0.1:{port}")
        friend.send(b"Hello")
        assert router.poll(10_000)
        identity, message = router.recv_multipart()
        assert message == b"Hello"
        router.send_multipart([identity, b"welcome"])
        assert friend.recv() == b"welcome"
        friend_ctx.destroy(linger=0)
    finally:
        head.destroy(linger=0)


def test_ipc_sockets_stay_plain(tmp_path):
    ctx = context(SECRET)
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(f"ipc://{tmp_path}/s")
        push.connect(f"ipc://{tmp_path}/s")
        assert not pull.getsockopt(zmq.CURVE_SERVER)
        push.send(b"local")
        assert pull.recv() == b"local"
    finally:
        ctx.destroy(linger=0)


def test_the_secret_file_must_be_private(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    assert read_secret_file(str(path)) == SECRET
    path.chmod(0o644)
    with pytest.raises(ValueError, match="mode 644.*chmod 600"):
        read_secret_file(str(path))
    path.chmod(0o600)
    path.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        read_secret_file(str(path))
    os.symlink(path, tmp_path / "link")
    with pytest.raises(ValueError, match="--cluster-secret-file"):
        read_secret_file(str(tmp_path / "link"))
    with pytest.raises(ValueError, match="No such file"):
        read_secret_file(str(tmp_path / "missing"))


def test_a_short_secret_in_the_environment_is_refused(monkeypatch):
    from parashift.engine.args import EngineArgs
    from parashift.runtime.node import ServeArgs

    monkeypatch.setenv("PARASHIFT_CLUSTER_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16.*token_hex"):
        ServeArgs(EngineArgs()).check_cluster_secret(tcp=True)
    monkeypatch.setenv("PARASHIFT_CLUSTER_SECRET", SECRET)
    ServeArgs(EngineArgs()).check_cluster_secret(tcp=True)


def test_keys_and_secrets_stay_out_of_reprs():
    from parashift.engine.args import EngineArgs
    from parashift.runtime.node import ServeArgs
    from parashift.serve.api_server import ApiServerArgs
    from parashift.wire.cluster_auth import HeadKeys

    keys = HeadKeys.mint(1)
    shown = repr(ServeArgs(EngineArgs(), api_key="sk-test-key")) + repr(ApiServerArgs(
        0, "r", "o", 1, "t", "m", 8, None, 8, api_key="sk-test-key", head_keys=keys))
    assert "sk-test-key" not in shown and keys.ranks[0].secret.decode() not in shown

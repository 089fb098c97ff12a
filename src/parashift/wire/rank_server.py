"""A ROUTER a launcher serves on a thread of its own, answering only the ranks' engines: the
base of the head's KV server (runtime/kv_server.py) and of the expert group's store
(distributed/group_store.py). Bound in the launcher's context, which runs CURVE on tcp under
the cluster secret: a peer without the secret completes no handshake, and a frame from one
that holds the secret but no rank's key (or any frame that is not [identity, message]) is
dropped and logged; on a plain link (ipc in the launch's 0700 folder) every peer is this
user's."""

from __future__ import annotations

import threading
import time

import zmq

from parashift.wire import protocol as p
from parashift.wire.cluster_auth import principal

_POLL_MS = 100


class RankServer(threading.Thread):
    link = "rank-server"  # its name in the log

    def __init__(self, ctx: zmq.Context, where: str, name: str):
        """`where`: the address to bind (tcp://host:0: a port the kernel picks)."""
        super().__init__(name=name, daemon=True)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(where)
        self.address: str = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._stopping = threading.Event()

    def serve(self, identity: bytes, frame: zmq.Frame) -> None:
        """One message from a rank's engine."""
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """After each poll (time-outs)."""

    def closed(self) -> None:
        """After the socket closed."""

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self.sock.poll(_POLL_MS):
                    frames = self.sock.recv_multipart(copy=False)
                    who = principal(frames[-1])
                    if len(frames) != 2 or (who is not None and not who.startswith("dp")):
                        p.log_dropped(self.link, f"a frame from {who or 'an unknown peer'}")
                    else:
                        self.serve(frames[0].bytes, frames[1])
                self.tick(time.monotonic())
        finally:
            self.sock.close()
            self.closed()

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(timeout=5)
        else:
            self.sock.close()

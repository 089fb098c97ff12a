"""An engine's heartbeat to the DP coordinator: a message a second from a thread with its own
socket, so that a long step never looks like death (the coordinator declares a rank that stays
silent past --heartbeat-timeout dead)."""

from __future__ import annotations

import threading

import zmq

from parashift.wire import protocol as p

HEARTBEAT_INTERVAL_S = 1.0


class Heartbeat:
    def __init__(self, ctx: zmq.Context, address: str, rank: int, incarnation: int):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True,
                                        args=(ctx, address, p.encode(p.Heartbeat(
                                            rank, incarnation))))
        self._thread.start()

    def _beat(self, ctx: zmq.Context, address: str, beat: bytes) -> None:
        sock = ctx.socket(zmq.PUSH)  # sockets are per thread: this one is the thread's own
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        while not self._stop.is_set():
            try:
                sock.send(beat, zmq.NOBLOCK)
            except zmq.ZMQError:  # not connected yet, or the context is closing
                pass
            self._stop.wait(HEARTBEAT_INTERVAL_S)
        sock.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * HEARTBEAT_INTERVAL_S)

"""An engine's heartbeat to the DP coordinator: a message a second from a thread with its own
socket, so that a long step never looks like death (the coordinator declares a rank that stays
silent past --heartbeat-timeout dead). Its last message, at a clean stop, says the rank leaves."""

from __future__ import annotations

import threading

import zmq

from parashift.wire import protocol as p

HEARTBEAT_INTERVAL_S = 1.0
LEAVING_LINGER_MS = 500  # how long the last message may wait for the coordinator


class Heartbeat:
    def __init__(self, ctx: zmq.Context, address: str, rank: int, incarnation: int):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True,
                                        args=(ctx, address, rank, incarnation))
        self._thread.start()

    def _beat(self, ctx: zmq.Context, address: str, rank: int, incarnation: int) -> None:
        sock = ctx.socket(zmq.PUSH)  # sockets are per thread: this one is the thread's own
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        beat = p.encode(p.Heartbeat(rank, incarnation))
        while not self._stop.is_set():
            try:
                sock.send(beat, zmq.NOBLOCK)
            except zmq.ZMQError:  # not connected yet, or the context is closing
                pass
            self._stop.wait(HEARTBEAT_INTERVAL_S)
        try:
            sock.send(p.encode(p.Heartbeat(rank, incarnation, leaving=True)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        sock.close(linger=LEAVING_LINGER_MS)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * HEARTBEAT_INTERVAL_S)

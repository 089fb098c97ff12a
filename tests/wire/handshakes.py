"""Waiting for a CURVE handshake's outcome by its socket monitor's events, not by time."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
          zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def refused(monitor: zmq.Socket) -> bool:
    """Whether the first handshake of the monitored socket was refused: it failed, or the peer
    closed the connection before it succeeded (an admitted key succeeds on its first try, and
    after a refusal libzmq may not try again, so no later event is awaited). The suite's
    timeout bounds the wait."""
    while True:
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return False
        if event in FAILED or event == zmq.EVENT_DISCONNECTED:
            return True

"""How long a client may take to move a body either way: a request's body it sends
(serve/intake.py), a non-streamed response's body it reads (serve/respond.py). No wait may
last longer than --stream-idle-timeout, and beyond that the body must move at MIN_RATE on
average (Apache's mod_reqtimeout MinRate): a client that trickles a byte at a time holds its
connection, and the memory its body pins, no longer than its bytes pay for."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

from aiohttp import web

MIN_RATE = 16 << 10  # bytes a second on average: 8 MiB may take 8.5 min past the idle bound
SEND_BUFFER = 64 << 10  # bytes; the kernel doubles it


class Pace:
    """The time limits of one body's transfer."""

    def __init__(self, idle_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.deadline = clock() + idle_timeout

    def timeout(self) -> float:
        """Seconds the next read or write may wait."""
        return max(0.0, min(self.idle_timeout, self.deadline - self.clock()))

    def moved(self, num_bytes: int) -> None:
        self.deadline += num_bytes / MIN_RATE


def small_send_buffer(request: web.Request) -> None:
    """The kernel grows a TCP send buffer up to tcp_wmem's max (4 MiB) for a client that reads
    nothing: a fixed one keeps what it holds small and a stalled client seen soon."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)

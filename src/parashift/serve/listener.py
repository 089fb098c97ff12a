"""An API server's accepting side: at most --max-connections open HTTP connections.

At the cap the server stops accepting instead of answering an error: further clients wait in
the listening socket's backlog (the same wait as during start-up), where another API server on
the same socket may take them, and none holds a descriptor or buffers of this process. Each
connection that closes lets one more in. A refusal (accept, then 503) would still cost one
accept and one descriptor per attempt, and would refuse a client another API server could
serve. The wait is bounded by how long one connection may hold its slot: a request's head
must arrive within KEEPALIVE_TIMEOUT_S of connecting (or of the last answer), its body keep
pace (serve/pacing.py: no pause of --stream-idle-timeout, a minimum rate), every answer be
read as it is written (no write waits --stream-idle-timeout: serve/respond.py, serve/sse.py);
a generation ends within --non-stream-timeout, a stream with its max_tokens (or
--request-timeout)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket

from aiohttp import web

# Seconds an idle keep-alive connection (or one that never sends a request) holds its slot;
# aiohttp's default is an hour.
KEEPALIVE_TIMEOUT_S = 75.0
BACKLOG = 2048  # as the launcher listens (runtime/endpoints.py); each start listens again
RETRY_S = 1.0  # after a failed start of accepting again

logger = logging.getLogger(__name__)


# Connections accepted past the cap in one burst that wait, parked, for a slot; the rest of a
# burst is closed at once (the loop accepts up to BACKLOG in one go before the pause).
MAX_PARKED = 256
# Descriptors an API server needs besides its connections: parked ones, engine links, files,
# the grammar compile process.
OWN_DESCRIPTORS = MAX_PARKED + 256


def allow_descriptors(max_connections: int) -> int:
    """Raises this process's soft limit on open descriptors to what max_connections needs
    (often 1,024 by default, while the hard limit allows far more); returns the limit now.
    Below the need (a hard limit too low), a warning names the flag."""
    import resource

    need = max_connections + OWN_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < need:
        logger.warning("open descriptors are limited to %d: fewer than --max-connections %d "
                       "needs (%d); raise the hard limit (ulimit -Hn) or lower the flag",
                       soft, max_connections, need)
    return soft


class _Parked(asyncio.Protocol):
    """A connection accepted past the cap: the loop accepts every pending connection in one
    go before the pause can take effect (uvloop cannot stop its server inside the accept).
    Read from by no one (reading paused) until a slot frees, then handed to aiohttp."""

    def __init__(self, parked: collections.deque[_Parked]) -> None:
        self.transport: asyncio.Transport | None = None
        self.parked = parked  # where it waits: it leaves when its client goes

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.pause_reading()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None
        with contextlib.suppress(ValueError):
            self.parked.remove(self)


class _Refused(asyncio.Protocol):
    """A connection accepted after stop() or past MAX_PARKED: closed at once (the client sees
    the connection closed, and may retry, on another API server)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class CappedListener:
    def __init__(self, server: web.Server, sock: socket.socket, max_connections: int):
        self.server, self.sock, self.max_connections = server, sock, max_connections
        self.num_open = 0  # handed to aiohttp, not closed yet
        self.most_open = 0  # the high-water mark (tests read it)
        self.accepting = asyncio.Event()  # set while the socket is listened on
        self._parked: collections.deque[_Parked] = collections.deque()
        self._listening: asyncio.AbstractServer | None = None
        self._resuming: asyncio.Task | None = None
        self._stopped = False
        # aiohttp has no hook for a connection's end but its Server's bookkeeping of it.
        lost = server.connection_lost

        def connection_lost(handler: web.RequestHandler, exc: BaseException | None = None
                            ) -> None:
            lost(handler, exc)
            self._release()

        server.connection_lost = connection_lost  # type: ignore[method-assign]

    async def start(self) -> None:
        await self._create_server()

    def stop(self) -> None:
        """Stops accepting for good; open connections stay, to drain, parked ones close."""
        self._stopped = True
        if self._listening is not None:  # at any count: no connection waits for a slot now
            self._listening.close()
            self._listening = None
            self.accepting.clear()
        if self._resuming is not None:
            self._resuming.cancel()
        while self._parked:
            parked = self._parked.popleft()
            if parked.transport is not None:
                parked.transport.close()

    def _accept(self) -> asyncio.BaseProtocol:
        if self._stopped or (self.num_open >= self.max_connections
                             and len(self._parked) >= MAX_PARKED):
            return _Refused()
        if self.num_open >= self.max_connections:
            parked = _Parked(self._parked)
            self._parked.append(parked)
            return parked
        self._opened()
        return self.server()

    def _opened(self) -> None:
        self.num_open += 1
        self.most_open = max(self.most_open, self.num_open)
        if self.num_open >= self.max_connections:
            # Not inside the accept: uvloop attaches the new transport to its server after
            # this factory returns.
            asyncio.get_running_loop().call_soon(self._pause)

    def _release(self) -> None:
        self.num_open -= 1
        self._resume()

    def _resume(self) -> None:
        """Free slots go first to parked connections, then to accepting again."""
        if self._stopped:
            return
        while self._parked and self.num_open < self.max_connections:
            parked = self._parked.popleft()
            transport = parked.transport
            if transport is None or transport.is_closing():
                continue
            self._opened()
            handler = self.server()
            transport.set_protocol(handler)
            handler.connection_made(transport)
            transport.resume_reading()
        if (self._listening is None and self._resuming is None
                and self.num_open < self.max_connections):
            self._resuming = asyncio.get_running_loop().create_task(self._listen())

    def _pause(self) -> None:
        if self._listening is not None and self.num_open >= self.max_connections:
            self._listening.close()  # stops accepting; open connections stay
            self._listening = None
            self.accepting.clear()

    async def _listen(self) -> None:
        """Accepting again; on an error (no descriptor left for the duplicate) it tries again
        after RETRY_S, since no connection may be left to close and call it."""
        try:
            await self._create_server()
        except OSError as e:
            logger.error("cannot accept connections again (%s); retrying in %g s", e, RETRY_S)
            loop = asyncio.get_running_loop()
            loop.call_later(RETRY_S, self._resume)
        finally:
            self._resuming = None

    async def _create_server(self) -> None:
        # A duplicate of the socket each time: closing a server closes the socket it was
        # given, and the listening socket must stay open (and keep its backlog).
        listening = await asyncio.get_running_loop().create_server(
            self._accept, sock=self.sock.dup(), backlog=BACKLOG)
        if self._stopped:
            listening.close()
            return
        self._listening = listening
        self.accepting.set()

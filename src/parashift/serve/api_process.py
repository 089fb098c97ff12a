"""An API server's process (aiohttp on uvloop): one per --api-server-count, all accepting on
the launcher's listening socket once every engine is ready (at most --max-connections open at
a time: serve/listener.py), draining on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

from aiohttp import web

from parashift.processes import (
    die_with_parent,
    exit_now,
    remove_launch_folder,
    set_process_name,
    setup_child_logging,
)
from parashift.serve.api_server import ApiServer, ApiServerArgs
from parashift.serve.listener import KEEPALIVE_TIMEOUT_S, CappedListener, allow_descriptors


async def _serve(args: ApiServerArgs, sock: socket.socket) -> None:
    server = ApiServer(args)
    server.engines.start()
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    await runner.setup()
    assert runner.server is not None
    listener = CappedListener(runner.server, sock, args.limits.max_connections)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    ended = [asyncio.create_task(stop.wait()),
             asyncio.create_task(server.engines.shutdown_requested.wait())]
    # Accept only once every engine is ready, as vLLM does: until then a client's connection
    # waits in the listener's backlog, so that a client polling /v1/models (or /health) is
    # answered when its requests can run, not with a 503 during the engines' start-up.
    ready = asyncio.create_task(server.engines.all_ready.wait())
    await asyncio.wait([ready, *ended], return_when=asyncio.FIRST_COMPLETED)
    serving = ready.done()
    ready.cancel()
    if serving:
        await listener.start()
        await server.engines.tell_launcher_ready()
        await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
        # Stop accepting, let in-flight requests drain within the timeout, abort the rest.
        listener.stop()
    deadline = time.monotonic() + server.engines.shutdown_timeout
    while server.engines.sinks and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await runner.cleanup()
    await server.engines.close()
    await asyncio.to_thread(server.grammars.shutdown)  # its compile process, if it started
    remove_launch_folder(args.request_address)  # here, where a 2nd SIGTERM cannot cut it short


def run_api_server(args: ApiServerArgs, sock: socket.socket) -> None:
    """Process entry point (multiprocessing target)."""
    set_process_name(f"parashift-api-{args.index}")
    die_with_parent()
    setup_child_logging(args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher orchestrates shutdown
    allow_descriptors(args.limits.max_connections)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(args, sock))
    exit_now(0)

"""The API server processes `parashift run` starts on its node, and the launcher's control
socket to each (on the server's request socket): the servers share the bound HTTP listener;
over its control socket each says when it has seen every engine, and hears of a dead engine
and of the shutdown."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from collections.abc import Callable

import zmq

from parashift.runtime.local_engines import join_all
from parashift.runtime.node import StartupError
from parashift.serve.api_process import run_api_server
from parashift.serve.api_server import ApiServerArgs
from parashift.wire import protocol as p
from parashift.wire.sockets import routing_id


class ApiServers:
    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self.identity = routing_id("launcher")  # the launcher's on each request socket
        self.procs: list[multiprocessing.Process] = []
        self.controls: list[zmq.Socket] = []

    def start(self, mp, args: ApiServerArgs, listener: socket.socket,
              cpus: tuple[int, ...] = ()) -> None:
        """One server, on `cpus` when the strategy kept cores for them."""
        proc = mp.Process(target=run_api_server, args=(args, listener),
                          name=f"parashift-api-{args.index}")
        proc.start()
        if cpus:
            os.sched_setaffinity(proc.pid, cpus)
        self.procs.append(proc)
        control = self.ctx.socket(zmq.DEALER)
        control.setsockopt(zmq.IDENTITY, self.identity)
        control.setsockopt(zmq.LINGER, 0)
        control.connect(args.request_address)
        self.controls.append(control)

    def wait_ready(self, timeout: float, check: Callable[[], None]) -> None:
        """Until every server has seen the engines; `check` raises to stop waiting (a child
        died, a signal came)."""
        deadline = time.monotonic() + timeout
        pending = set(range(len(self.controls)))
        while pending:
            check()
            if time.monotonic() > deadline:
                raise StartupError(f"API server(s) {sorted(pending)} did not see the engines "
                                   f"within {timeout:.0f} s")
            for i in list(pending):
                if self.controls[i].poll(50):
                    msg = p.decode_or_drop(self.controls[i].recv(), p.ApiServerReady,
                                           "api-server control")
                    if msg is not None:
                        pending.discard(msg.index)

    def check_alive(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                raise StartupError(f"API server {i} exited with code {proc.exitcode}")

    def announce(self, news: p.EngineDead | p.RankDraining | p.RankRemoved) -> None:
        """A rank's news for every server: it died (they route around it), it drains or it
        left (a scale-down)."""
        for control in self.controls:
            control.send(p.encode(news), zmq.NOBLOCK)

    def ask_to_drain(self, timeout: float) -> None:
        for control in self.controls:
            try:
                control.send(p.encode(p.Shutdown(timeout)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def join(self, timeout: float) -> None:
        join_all(self.procs, timeout)

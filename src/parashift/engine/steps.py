"""How an engine process steps its core between polls of its sockets: on its own, when it has
requests (Steps), or in waves with the other engines of its group (engine/lockstep.py). The
engine's loop consults this one object; it knows no mode."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import zmq

from parashift.engine.core import EngineCore
from parashift.types.outputs import EngineCoreOutput
from parashift.wire import protocol as p


class Steps:
    def __init__(self, core: EngineCore, publish: Callable[[list[EngineCoreOutput]], None],
                 publish_stats: Callable[[], None] = lambda: None):
        self.core = core
        self.publish = publish
        self.publish_stats = publish_stats  # the engine's stats alone, with no output

    def has_work(self) -> bool:
        return self.core.has_work()

    def sockets(self) -> list[zmq.Socket]:
        """Sockets of its own for the loop to poll beside the request sockets."""
        return []

    def on_socket(self, sock: zmq.Socket) -> None:
        """One of `sockets()` is readable."""

    def before_settle(self, sleep: Any) -> None:
        """Before the loop lets a sleep call settle (SleepState)."""

    def step(self) -> None:
        if self.core.has_work():
            outputs = self.core.step()
            self.publish(outputs)
            if not outputs and not self.core.has_work():  # its last KV copies ended
                self.publish_stats()
        else:
            self.core.executor.check_health()  # a dead tp worker takes its rank down now

    def extend_load(self, load: p.EngineLoad) -> Hashable:
        """Adds what this way of stepping reports to the engine's load report; returns what
        makes the report worth sending again when it changes."""
        return None

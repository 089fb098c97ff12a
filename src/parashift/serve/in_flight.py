"""What one API server awaits from the engines: each request in flight with its engine and its
sink (where its outputs and its failure go, called in the event loop), counted per engine for
the router, and each utility call with its future. A dead engine fails what it held."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from parashift.serve.engine_loads import EngineLoads
from parashift.types.outputs import EngineCoreOutput
from parashift.wire import protocol as p

Sink = Callable[[EngineCoreOutput | Exception], None]


class InFlight:
    def __init__(self, loads: EngineLoads) -> None:
        self.loads = loads
        self.sinks: dict[str, Sink] = {}
        self.engine_of: dict[str, int] = {}
        self.tokens_of: dict[str, int] = {}  # its prompt and max_tokens: its token load
        self.calls: dict[int, tuple[int, asyncio.Future]] = {}  # call id -> (rank, reply)
        self._call_ids = itertools.count()

    # --- requests ----------------------------------------------------------------------------
    def add(self, request_id: str, rank: int, sink: Sink, tokens: int = 0) -> None:
        self.sinks[request_id] = sink
        self.engine_of[request_id] = rank
        self.tokens_of[request_id] = tokens
        self.loads.in_flight[rank] += 1
        self.loads.in_flight_tokens[rank] += tokens

    def forget(self, request_id: str) -> int | None:
        """The request's engine, if it was in flight."""
        self.sinks.pop(request_id, None)
        rank = self.engine_of.pop(request_id, None)
        if rank is not None:
            self.loads.in_flight[rank] -= 1
            self.loads.in_flight_tokens[rank] -= self.tokens_of.pop(request_id)
        return rank

    def deliver(self, out: EngineCoreOutput) -> None:
        sink = self.sinks.get(out.request_id)
        if sink is None:  # aborted on our side already
            return
        if out.finished:  # before the sink, which may send the request on (serve/handoff.py)
            self.loads.on_finished()
            self.forget(out.request_id)
        sink(out)

    def fail(self, request_id: str, rank: int, error: Exception) -> None:
        """`rank` could not serve one of its requests."""
        sink = self.sinks.get(request_id)
        if sink is not None and self.engine_of.get(request_id) == rank:
            self.forget(request_id)  # before the sink, which may send the request on
            sink(error)

    # --- utility calls -----------------------------------------------------------------------
    def new_call(self, rank: int) -> tuple[int, asyncio.Future]:
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self.calls[call_id] = (rank, future)
        return call_id, future

    def answer(self, msg: p.UtilityResult) -> None:
        rank, future = self.calls.get(msg.call_id, (None, None))
        if rank != msg.rank:  # no call of ours to that rank
            return
        del self.calls[msg.call_id]
        if future.done():  # its caller gave up
            return
        if msg.error:
            future.set_exception(RuntimeError(msg.error))
        else:
            future.set_result(msg.result)

    def tell_engine(self, rank: int, error: Exception) -> None:
        """Every request `rank` holds hears `error` and decides (they stay in flight)."""
        for req_id, r in list(self.engine_of.items()):
            if r == rank and (sink := self.sinks.get(req_id)) is not None:
                sink(error)

    # --- a dead engine -----------------------------------------------------------------------
    def fail_engine(self, rank: int, error: Exception) -> None:
        """Every request and call `rank` held fails with `error`."""
        for req_id, r in list(self.engine_of.items()):
            if r == rank:
                sink = self.sinks.get(req_id)
                self.forget(req_id)
                if sink is not None:
                    sink(error)
        for call_id, (r, future) in list(self.calls.items()):
            if r == rank:
                del self.calls[call_id]
                if not future.done():
                    future.set_exception(error)

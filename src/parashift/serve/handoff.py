"""Prefill/decode pools as an API server routes them: no proxy, two phases per engine request.

Phase one goes to a prefill rank (by load and prefix, as any request): it computes the prompt
and samples the first token, which streams to the client at once, then stores the prompt's KV
blocks in the node's host tier and finishes as handed off once they are published. Phase two
goes to the least loaded decode rank with the tokens generated so far: its connector loads
the blocks from the tier (the request waits in WAITING_FOR_KV) and it continues as if it had
sampled them itself (the seeded draw is a function of the output position, penalties and
grammars see the earlier tokens). The request keeps its id across the phases, so an abort
reaches the rank holding it now, and a rank's death fails what that rank holds (failover:
serve/generation.py). With no serving rank in a pool, the other pool's ranks stand in: a
deployment that lost one pool serves on the other, slower, rather than failing. A request
pinned to a rank (X-data-parallel-rank) runs there whole."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from parashift.serve.engine_errors import (
    DecodeRefusedError,
    EngineDeadError,
    EngineUnavailableError,
    RequestFailedError,
)
from parashift.serve.engine_loads import EngineLoads
from parashift.serve.in_flight import Sink
from parashift.strategies.disaggregated import pool_of
from parashift.types.outputs import EngineCoreOutput
from parashift.wire import protocol as p

HANDED_OFF = "handoff"  # a prefill rank's finish: the decode goes on elsewhere


@dataclass(frozen=True)
class EnginePools:
    """Ranks 0..prefill-1 prefill, the rest decode (strategies/disaggregated.py)."""

    prefill: int

    def of(self, rank: int) -> str:
        return pool_of(rank, self.prefill)

    def choose(self, pool: str, serving: list[int]) -> list[int]:
        """The serving ranks of `pool`, or all of them when that pool has none."""
        mine = [r for r in serving if self.of(r) == pool]
        return mine or serving


class Handoff:
    """The sink of a request in both phases: outputs pass through to the request's own sink,
    except the handed-off finish, which starts the decode phase (`continue_on(self)`, a
    DecodePhase: it picks a rank outside `refused`, records it in `rank`, and reports its own
    failures to `sink`).
    A decode rank whose queue is full (429) is refused and the decode goes on elsewhere, the
    prefill pool's ranks included (they can decode too), before the request hears of it;
    refused by all, the request hears a DecodeRefusedError, whose `resume` starts this phase
    again once it has waited for room (serve/generation.py)."""

    def __init__(self, sink: Sink, continue_on: Callable[[Handoff], None]):
        self.sink = sink
        self.continue_on = continue_on
        self.generated: list[int] = []
        self.rank: int | None = None  # the decode phase's
        self.refused: set[int] = set()

    def __call__(self, item: EngineCoreOutput | Exception) -> None:
        if isinstance(item, EngineCoreOutput):
            if item.finish_reason == HANDED_OFF:
                self.continue_on(self)
                return
            if self.rank is None:  # the prefill phase's: what the decode phase continues
                self.generated.extend(item.new_token_ids)
        elif (self.rank is not None and isinstance(item, RequestFailedError)
              and item.status == 429):
            self.refused.add(self.rank)
            self.continue_on(self)
            return
        self.sink(item)


class Engines(Protocol):
    """What the decode phase needs of the engine client (serve/engine_client.py)."""

    client_index: int
    pools: EnginePools | None
    loads: EngineLoads

    def alive_engines(self) -> list[int]: ...

    def health(self) -> tuple[bool, str]: ...

    def send_request(self, rank: int, msg: p.AddRequest, sink: Sink) -> None: ...


class DecodePhase:
    """A Handoff's `continue_on` for the request `prefill` (a prefill rank published its KV,
    or a decode rank refused it): the request goes on at the least loaded decode rank outside
    `refused`, with the tokens generated so far, under the same id."""

    def __init__(self, prefill: p.AddRequest, engines: Engines):
        self.prefill, self.engines = prefill, engines

    def __call__(self, handoff: Handoff) -> None:
        engines, prefill = self.engines, self.prefill
        assert engines.pools is not None
        msg = p.AddRequest(prefill.request_id, prefill.prompt_token_ids, prefill.params,
                           prefill.eos_token_id, engines.client_index, time.monotonic(),
                           generated_token_ids=list(handoff.generated))
        serving = [r for r in engines.alive_engines() if r not in handoff.refused]
        candidates = engines.pools.choose("decode", serving)
        if not candidates:
            error = (DecodeRefusedError("every live rank's waiting queue is full",
                                        lambda: self.resume(handoff))
                     if handoff.refused else EngineDeadError(
                         f"no rank can continue the request ({engines.health()[1]})"))
            handoff.sink(error)  # (serve/generation.py waits for room, or fails it over)
            return
        handoff.rank = min(candidates, key=engines.loads.score)
        try:
            engines.send_request(handoff.rank, msg, handoff)
        except EngineUnavailableError as e:
            handoff.sink(EngineDeadError(f"no decode rank can continue the request ({e})",
                                         handoff.rank))

    def resume(self, handoff: Handoff) -> None:
        """Again from every decode rank, once the request has waited for room."""
        handoff.refused.clear()
        self(handoff)

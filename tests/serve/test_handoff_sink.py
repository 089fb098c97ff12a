"""The two phases as a request's sink sees them (serve/handoff.py): the prefill rank's first
token passes through, its handed-off finish starts the decode phase with the tokens so far,
a decode rank's 429 is refused there and the decode goes on elsewhere, every other outcome
reaches the request; and which ranks each pool offers."""

from __future__ import annotations

from parashift.serve.engine_errors import EngineDeadError, RequestFailedError
from parashift.serve.handoff import HANDED_OFF, EnginePools, Handoff
from parashift.types.outputs import EngineCoreOutput


class Decodes:
    """The engine client's side: each decode phase it is asked for, on ranks 1, 2, ..."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], set[int]]] = []

    def __call__(self, handoff: Handoff) -> None:
        self.calls.append((list(handoff.generated), set(handoff.refused)))
        handoff.rank = len(self.calls)


def test_the_phases_and_a_full_decode_rank():
    seen: list = []
    decodes = Decodes()
    sink = Handoff(seen.append, decodes)
    first = EngineCoreOutput("r", [7], None, None)
    sink(first)
    sink(EngineCoreOutput("r", [], None, HANDED_OFF))
    assert seen == [first] and decodes.calls == [([7], set())]  # the finish is not shown
    sink(RequestFailedError("full", 429))  # dp1 refused it: dp2 next, not the request
    assert decodes.calls[-1] == ([7], {1}) and seen == [first]
    more = EngineCoreOutput("r", [8], None, None)
    sink(more)
    sink(RequestFailedError("bad", 400))  # not a full queue: the request hears it
    dead = EngineDeadError("engine dp2 died", 2)
    sink(dead)
    assert seen[1] == more and isinstance(seen[2], RequestFailedError) and seen[3] is dead


def test_a_429_before_the_decode_phase_is_the_request_s():
    seen: list = []
    sink = Handoff(seen.append, Decodes())
    full = RequestFailedError("full", 429)  # from the prefill rank: the request moves itself
    sink(full)
    assert seen == [full]


def test_each_pool_and_the_stand_in():
    pools = EnginePools(2)
    assert [pools.of(r) for r in range(4)] == ["prefill", "prefill", "decode", "decode"]
    assert pools.choose("prefill", [0, 2, 3]) == [0]
    assert pools.choose("decode", [0, 1, 3]) == [3]
    assert pools.choose("decode", [0, 1]) == [0, 1]  # no decode rank serves: the others do
    assert pools.choose("prefill", []) == []

"""Each engine's load as one API server sees it, and the score its router picks the least
loaded rank by: the coordinator's last vector plus what this server sent since, or, without a
coordinator (dp1, or before its first vector), this server's own requests in flight. With how
fast its requests finish, it says when a refused client should come back (serve/overload.py)."""

from __future__ import annotations

from collections import Counter

from parashift.serve.overload import DrainRate, RoomWaiters, retry_after
from parashift.wire import protocol as p


class EngineLoads:
    def __init__(self) -> None:
        self.vector: dict[int, p.EngineLoad] = {}  # every rank's, from the coordinator
        self.sent_since_update: Counter[int] = Counter()
        self.in_flight: Counter[int] = Counter()  # this server's requests, by rank
        self.drain = DrainRate()  # how fast this server's requests finish (on every rank)
        self.room = RoomWaiters()  # requests every live rank refused, waiting for a finish

    def score(self, rank: int) -> int:
        """Waiting requests weigh more than running ones (they have not even started)."""
        load = self.vector.get(rank)
        if load is None:
            return self.in_flight[rank]
        return (4 * load.stats.num_waiting + load.stats.num_running
                + self.sent_since_update[rank])

    def take(self, vector: p.LoadVector) -> list[int]:
        """A new vector; the ranks whose prefix cache was emptied since the last one (a reset
        or a sleep, called through any API server)."""
        emptied = [load.rank for load in vector.loads
                   if (last := self.vector.get(load.rank)) is not None
                   and last.stats.num_prefix_cache_resets != load.stats.num_prefix_cache_resets]
        for load in vector.loads:  # requests another server's clients had there finished
            if (last := self.vector.get(load.rank)) is not None:
                self.room.wake(_held(last) - _held(load))
        self.vector = {load.rank: load for load in vector.loads}
        self.sent_since_update.clear()
        return emptied

    def on_finished(self) -> None:
        """One of this server's requests finished: a slot on its rank is free."""
        self.drain.on_finished()
        self.room.wake()

    def retry_after(self, ranks: list[int]) -> float:
        """Seconds until this server's requests held on `ranks` (full ones), those waiting for
        room, and then one more would have finished at the rate its requests finish: in a
        first-come queue its share drains as fast as the whole."""
        backlog = sum(self.in_flight[r] for r in ranks) + len(self.room) + 1
        return retry_after(backlog, self.drain.per_second())


def _held(load: p.EngineLoad) -> int:
    return load.stats.num_waiting + load.stats.num_running

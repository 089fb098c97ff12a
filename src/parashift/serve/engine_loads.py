"""Each engine's load as one API server sees it, and the score its router picks the least
loaded rank by: the coordinator's last vector plus what this server sent that the vector does
not include yet (each engine's load counts the requests it has taken from each API server), or,
without a coordinator (dp1, or before its first vector), this server's own requests in
flight. With how
fast its requests finish, it says when a refused client should come back (serve/overload.py).

The score (`--dp-load-score`) counts the rank's work in tokens (the prompt tokens it has still
to compute plus the output tokens its requests may still make; a request sent counts its
prompt and its max_tokens), or its requests (4 per waiting one, 1 per running): by requests, a
rank with one waiting 10,000-token prompt looks lighter than one with two 100-token ones."""

from __future__ import annotations

from collections import Counter, defaultdict, deque

from parashift.serve.overload import DrainRate, RoomWaiters, retry_after
from parashift.wire import protocol as p


class EngineLoads:
    def __init__(self, by_tokens: bool = True, client_index: int = 0) -> None:
        self.by_tokens = by_tokens
        self.client_index = client_index  # this API server's: the engines count by it
        self.vector: dict[int, p.EngineLoad] = {}  # every rank's, from the coordinator
        # By rank: what this server sent that no vector includes yet, as (number, tokens),
        # numbered from `sent_base` (the count when the rank's incarnation began).
        self.unseen: dict[int, deque[tuple[int, int]]] = defaultdict(deque)
        self.sent_count: Counter[int] = Counter()
        self.sent_base: Counter[int] = Counter()
        # By rank: this server's requests in flight (and their tokens).
        self.in_flight: Counter[int] = Counter()
        self.in_flight_tokens: Counter[int] = Counter()
        self.drain = DrainRate()  # how fast this server's requests finish (on every rank)
        self.room = RoomWaiters()  # requests every live rank refused, waiting for a finish

    def score(self, rank: int) -> int:
        load = self.vector.get(rank)
        if self.by_tokens:
            if load is None:
                return self.in_flight_tokens[rank]
            return (load.stats.prefill_tokens_left + load.stats.output_tokens_left
                    + sum(tokens for _, tokens in self.unseen[rank]))
        if load is None:
            return self.in_flight[rank]
        # Waiting requests weigh more than running ones (they have not even started).
        return 4 * load.stats.num_waiting + load.stats.num_running + len(self.unseen[rank])

    def sent(self, rank: int, tokens: int) -> None:
        """An engine request went to `rank`: `tokens`, its prompt and max_tokens."""
        self.sent_count[rank] += 1
        self.unseen[rank].append((self.sent_count[rank], tokens))

    def new_incarnation(self, rank: int) -> None:
        """The rank (re)started: its counts start again; what went to the last one is gone."""
        self.sent_base[rank] = self.sent_count[rank]
        self.unseen[rank].clear()

    def _seen(self, load: p.EngineLoad) -> None:
        """Drop what `load` includes: the requests its engine had taken from this server."""
        if self.client_index >= len(load.received):
            return
        taken = self.sent_base[load.rank] + load.received[self.client_index]
        unseen = self.unseen[load.rank]
        while unseen and unseen[0][0] <= taken:
            unseen.popleft()

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
        for load in vector.loads:
            self._seen(load)
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

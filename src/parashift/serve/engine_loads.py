"""Each engine's load as one API server sees it, and the score its router picks the least
loaded rank by: the coordinator's last vector plus what this server sent in the last
SENT_GRACE_S, or, without a coordinator (dp1, or before its first vector), this server's own
requests in flight. With how
fast its requests finish, it says when a refused client should come back (serve/overload.py).

The score (`--dp-load-score`) counts the rank's work in tokens (the prompt tokens it has still
to compute plus the output tokens its requests may still make; a request sent counts its
prompt and its max_tokens), or its requests (4 per waiting one, 1 per running): by requests, a
rank with one waiting 10,000-token prompt looks lighter than one with two 100-token ones."""

from __future__ import annotations

import time
from collections import Counter, deque

from parashift.serve.overload import DrainRate, RoomWaiters, retry_after
from parashift.wire import protocol as p

SENT_GRACE_S = 0.3  # the coordinator's publication interval and then some


class EngineLoads:
    def __init__(self, by_tokens: bool = True, grace_s: float = SENT_GRACE_S) -> None:
        self.by_tokens = by_tokens
        self.grace_s = grace_s
        self.vector: dict[int, p.EngineLoad] = {}  # every rank's, from the coordinator
        # What this server sent lately: (when, rank, tokens). A vector may have been made
        # before a rank heard of them, so they count until `grace_s` have passed (a
        # rank that has them in its vector counts them twice meanwhile: it is busy).
        self.sent_lately: deque[tuple[float, int, int]] = deque()
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
                    + sum(tokens for _, r, tokens in self._sent() if r == rank))
        if load is None:
            return self.in_flight[rank]
        # Waiting requests weigh more than running ones (they have not even started).
        return (4 * load.stats.num_waiting + load.stats.num_running
                + sum(r == rank for _, r, _ in self._sent()))

    def sent(self, rank: int, tokens: int) -> None:
        """A request went to `rank`: `tokens`, its prompt and max_tokens (over its samples)."""
        self.sent_lately.append((time.monotonic(), rank, tokens))

    def _sent(self) -> deque[tuple[float, int, int]]:
        expired = time.monotonic() - self.grace_s
        while self.sent_lately and self.sent_lately[0][0] < expired:
            self.sent_lately.popleft()
        return self.sent_lately

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

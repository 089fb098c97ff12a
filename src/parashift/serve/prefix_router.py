"""Which rank a new request goes to (`--routing`), inside each API server's broker:

- `prefix` (default): where its prompt's leading blocks were last sent, so that the engine's
  prefix cache serves them. Each API server keeps, per rank, an approximate LRU index of the
  block hashes (engine/block_hash.py, the engine's own) it routed there, as many as that
  rank's KV cache holds. Of the ranks where at least `min_match` of the prompt's full blocks
  are and whose load is within `balance_threshold` of the least loaded rank's (the balance
  guard), the one holding the most blocks wins (then the less loaded) with the tokens score,
  and the best matched blocks minus requests score with the requests score; with none, the
  load rule decides (and the request's blocks then live there). With a host KV tier shared
  by a node's ranks (--kv-offloading-size), what was routed to any of them is in the tier: it
  counts as matched on each of them (an index per tier), so the load picks among them.
- `load`: the lowest load score (the coordinator's view plus what this server sent since;
  `--dp-load-score`: the rank's work in tokens, or its requests: serve/engine_loads.py).
- `round-robin`: each rank in turn.

Each API server keeps its own index (no traffic between them): with --api-server-count N a
conversation whose turns reach different API servers is routed by each one's view. A request's
cache_salt enters its hashes as it does the engine's (`prompt_hashes`): a tenant's prompt is
routed to where its own blocks live, never by another tenant's."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from parashift.defaults import (
    DEFAULT_DP_LOAD_SCORE,
    DEFAULT_ROUTING,
    DEFAULT_ROUTING_BALANCE_THRESHOLD,
    DEFAULT_ROUTING_BALANCE_THRESHOLD_TOKENS,
    DEFAULT_ROUTING_MIN_MATCH,
)
from parashift.engine.block_hash import block_hashes

ROUTING_POLICIES = ("prefix", "load", "round-robin")
LOAD_SCORES = ("tokens", "requests")


def prompt_hashes(prompts: Sequence[Sequence[int]], block_size: int, salt: str | None = None
                  ) -> list[list[int]]:
    """Each prompt's full blocks' hashes, as the engine's prefix cache computes them for a
    request with `salt` (its cache_salt)."""
    return [block_hashes(prompt, block_size, salt=salt) for prompt in prompts]


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = DEFAULT_ROUTING
    balance_threshold: int | None = None  # in the load score's units; None: its default
    min_match: float = DEFAULT_ROUTING_MIN_MATCH
    load_score: str = DEFAULT_DP_LOAD_SCORE

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"--routing {self.policy!r}: use one of "
                             f"{', '.join(ROUTING_POLICIES)}")
        if self.load_score not in LOAD_SCORES:
            raise ValueError(f"--dp-load-score {self.load_score!r}: use one of "
                             f"{', '.join(LOAD_SCORES)}")
        if self.balance_threshold is None:
            object.__setattr__(self, "balance_threshold", (
                DEFAULT_ROUTING_BALANCE_THRESHOLD_TOKENS if self.by_tokens
                else DEFAULT_ROUTING_BALANCE_THRESHOLD))
        elif self.balance_threshold < 0:
            raise ValueError("--routing-balance-threshold must be >= 0")
        if not 0.0 <= self.min_match <= 1.0:
            raise ValueError("--routing-min-match must be within 0..1")

    @property
    def by_tokens(self) -> bool:
        return self.load_score == "tokens"


class RankPrefixIndex:
    """The block hashes last routed to one rank, least recently routed evicted first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def matched(self, hashes: Sequence[int]) -> int:
        """How many of the leading blocks are here (a chain: the first miss ends it)."""
        count = 0
        for h in hashes:
            if h not in self.blocks:
                break
            count += 1
        return count

    def record(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class Router:
    def __init__(self, config: RoutingConfig, num_engines: int):
        self.config = config
        self.num_engines = num_engines
        self.indexes: dict[int, RankPrefixIndex] = {}
        self.tiers: dict[str, RankPrefixIndex] = {}  # a host KV tier's name -> its index
        self.tier_of: dict[int, str] = {}
        self._turn = itertools.count()

    def add_rank(self, rank: int, capacity_blocks: int, tier: str | None = None,
                 tier_blocks: int = 0) -> None:
        """A rank became ready (again: a restarted rank's cache starts empty; the tier it
        shares keeps what it held)."""
        self.indexes[rank] = RankPrefixIndex(max(1, capacity_blocks))
        if tier is not None:
            self.tier_of[rank] = tier
            if tier not in self.tiers:
                self.tiers[tier] = RankPrefixIndex(max(1, tier_blocks))

    def remove(self, rank: int) -> None:
        """The rank left the deployment (its node's tier keeps what was stored there)."""
        self.indexes.pop(rank, None)
        self.tier_of.pop(rank, None)

    def forget(self, rank: int) -> None:
        """The rank's prefix cache was emptied (reset, sleep, wake)."""
        if rank in self.indexes:
            self.indexes[rank].blocks.clear()

    def choose(self, alive: list[int], hashes: Sequence[int],
               load: Callable[[int], int]) -> int:
        turn = next(self._turn)
        if self.config.policy == "round-robin":
            return alive[turn % len(alive)]
        # lowest load score; ties rotate so that equal ranks share the load
        by_load = min(alive, key=lambda r: (load(r), (r - turn) % self.num_engines))
        if self.config.policy == "load" or not hashes:
            return by_load
        matched = {r: self._matched(r, hashes) for r in alive}
        # ranks whose cache holds enough of the prompt, within the balance guard; of those,
        # the best score: what its cache would serve minus its load score
        enough = max(1.0, self.config.min_match * len(hashes))
        eligible = [r for r in alive if matched[r] >= enough
                    and load(r) - load(by_load) <= self.config.balance_threshold]
        if not eligible:
            return by_load
        if self.config.by_tokens:  # the guard bounds the imbalance in tokens: within it, the cache
            return max(eligible, key=lambda r: (matched[r], -load(r)))
        return max(eligible, key=lambda r: (matched[r] - load(r), matched[r]))

    def _matched(self, rank: int, hashes: Sequence[int]) -> int:
        local = self.indexes[rank].matched(hashes) if rank in self.indexes else 0
        tier = self.tiers.get(self.tier_of.get(rank, ""))
        return max(local, tier.matched(hashes)) if tier is not None else local

    def record(self, rank: int, hashes: Sequence[int]) -> None:
        if self.config.policy == "prefix" and rank in self.indexes:
            self.indexes[rank].record(hashes)
            if rank in self.tier_of:
                self.tiers[self.tier_of[rank]].record(hashes)

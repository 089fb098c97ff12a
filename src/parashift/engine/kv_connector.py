"""The KV connector seam: what the scheduler asks of anything that holds KV blocks outside the
engine's pool (the host and disk tiers today, another engine for prefill/decode disaggregation
next). The scheduler never waits on a transfer: a request whose blocks load waits in its own
state (WAITING_FOR_KV) and the connector says when they are in.

- `begin_load`: for a waiting request and its local prefix hit, start loading the blocks the
  connector holds beyond it, into blocks of the pool it allocates and holds itself: NOW
  when they load before this step's forward (cached in the pool already: the admission
  looks again), WAIT when the request must wait for them (a disk read, another request's
  load), NONE when there is nothing to load.
- `store`: the request's blocks the scheduler just filled, to keep beyond the pool.
- `take_jobs`: the copies the workers start with the step being made.
- `settle`: the requests whose loads ended (their blocks, if they arrived, are cached in the
  pool now, so their admission finds them as prefix hits).
- `storing`: stores of a request's blocks are still copying (a prefill pool's request
  finishes once its blocks are out).
- `release`: a request was admitted: what the connector held for it (its loaded blocks, so
  that nothing evicts them before) is its own now.
- `forget`: a request that finished or was aborted (a waiting load goes on, without it)."""

from __future__ import annotations

import enum
from typing import Protocol

from parashift.engine.kv_cache import KVCacheBlock
from parashift.engine.request import Request
from parashift.types.outputs import KVTierStats, KVTransferJob


class LoadStart(enum.Enum):
    NONE = "none"
    NOW = "now"
    WAIT = "wait"


class KVConnector(Protocol):
    def begin_load(self, request: Request, hits: list[KVCacheBlock]) -> LoadStart: ...

    def store(self, request: Request) -> None: ...

    def take_jobs(self) -> list[KVTransferJob]: ...

    def settle(self) -> list[Request]: ...

    def storing(self, request_id: str) -> bool: ...

    def release(self, request: Request) -> None: ...

    def forget(self, request: Request) -> None: ...

    stats: KVTierStats

    @property
    def busy(self) -> bool:
        """Transfers in flight."""
        ...

    def close(self) -> None: ...

"""The node's disk writer: a thread that copies the host arena's blocks to the disk tier in
the background (kv_tiers/disk_tier.py), run by the one engine of the node that holds the disk
folder's writer lock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from parashift.kv_tiers.disk_tier import DiskTier

logger = logging.getLogger(__name__)


class PersistableArena(Protocol):
    """What DiskWriter needs of the host arena (kv_tiers/host_arena.py)."""

    def unpersisted(self, limit: int) -> list[tuple[int, int]]: ...

    def slot(self, index: int) -> memoryview: ...

    def mark_persisted(self, slots: Sequence[int]) -> None: ...

    def unpin(self, slots: Sequence[int]) -> None: ...


class DiskWriter(threading.Thread):
    """Copies the host arena's blocks to the disk tier in the background, 64 at a time."""

    BATCH = 64
    IDLE_WAIT_S = 0.05
    # After a failed write (a full disk): the arena offers the same blocks first again, so
    # retrying at once would spin. wake() does not cut this wait short; stop() does.
    RETRY_AFTER_ERROR_S = 1.0

    def __init__(self, tier: DiskTier, arena: PersistableArena):
        super().__init__(name="parashift-kv-disk", daemon=True)
        self.tier = tier
        self.arena = arena
        self._wake = threading.Event()
        self._stopping = threading.Event()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self.is_alive():
            self.join()

    def run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()  # before the batch: a wake() during it is not lost
            num_persisted, num_failed = self.persist_batch()
            if num_failed:
                self._stopping.wait(self.RETRY_AFTER_ERROR_S)
            elif not num_persisted:
                self._wake.wait(self.IDLE_WAIT_S)

    def persist_batch(self) -> tuple[int, int]:
        """One batch: (blocks now on disk, blocks whose write failed). Only the first are marked
        persisted (the others are offered again); every slot of the batch is unpinned."""
        batch = self.arena.unpersisted(limit=self.BATCH)
        persisted: list[int] = []
        try:
            for slot, key in batch:
                if self.tier.write(key, self.arena.slot(slot)):
                    persisted.append(slot)
        finally:
            if persisted:
                self.arena.mark_persisted(persisted)
            if batch:
                self.arena.unpin([slot for slot, _ in batch])
        return len(persisted), len(batch) - len(persisted)

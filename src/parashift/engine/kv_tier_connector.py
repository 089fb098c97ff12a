"""The KV connector of the host and disk tiers (engine/kv_connector.py is the seam).

Stores: a request's prompt blocks, once a step filled them, are copied to the node's host
arena (write-through; a block some rank stored already is skipped), the pool's block held
until its copy is reported. The node's disk writer (the engine holding the disk folder's
writer lock) persists what the arena holds in the background.

Loads: for a waiting request, the blocks beyond its local prefix hit that the arena holds
(pinned there) are copied into blocks of the pool allocated for the job, by every worker
before the forward of the step being made: they are cached in the pool at once and the
request is admitted in that step with them as its prefix hit. Blocks on disk are first read
into arena slots by a reader thread while the request waits (WAITING_FOR_KV); then loaded
the same way, and the request waits for admission again. A request that needs a block
another job is loading waits for that job. A job owns its blocks and pins, so a request
aborted while loading frees nothing the copy still writes: the job frees them when it ends."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from parashift.engine.kv_cache import KVCacheBlock, KVCacheManager
from parashift.engine.kv_connector import LoadStart
from parashift.engine.request import Request
from parashift.kv_tiers.host_arena import HostArena
from parashift.kv_tiers.identity import tier_key
from parashift.kv_tiers.job_board import DONE, PENDING, JobBoard
from parashift.types.outputs import KVTierStats, KVTransferJob

if TYPE_CHECKING:
    from parashift.kv_tiers.disk_tier import DiskTier
    from parashift.kv_tiers.disk_writer import DiskWriter
    from parashift.kv_tiers.remote_tier import RemoteTier

logger = logging.getLogger(__name__)

MAX_JOBS = 64  # transfers in flight; past it stores are skipped and loads recompute
_WRITER_RETRY_S = 2.0


@dataclass
class _Job:
    id: int
    load: bool
    blocks: list[KVCacheBlock]
    hashes: list[int]
    slots: list[int]
    num_host: int = 0  # of a load: slots found in the arena; the rest are read from disk
    num_read: int = 0  # of those, read intact
    remote: bool = False  # of a load: the rest fetched from the head node (not read from disk)
    owner: str = ""  # of a store: its request's id
    urgent: bool = False  # of a store: copied within its step (a hand-off's last blocks)
    waiters: list[Request] = field(default_factory=list)
    reading: Future | None = None
    started: float = field(default_factory=time.monotonic)


class TierConnector:
    def __init__(self, kv_cache: KVCacheManager, arena: HostArena, identity: bytes,
                 block_bytes: int, num_workers: int, disk: DiskTier | None = None,
                 disk_folder: str | None = None, disk_size: int = 0, store_decode: bool = False):
        self.kv_cache, self.pool = kv_cache, kv_cache.pool
        self.store_decode = store_decode
        self.block_size = kv_cache.block_size
        self.arena, self.identity, self.block_bytes = arena, identity, block_bytes
        self.board = JobBoard.create(MAX_JOBS, num_workers)
        self.disk = disk
        self._disk_args = (disk_folder, disk_size)
        self._writer: DiskWriter | None = None
        self._writer_lock: int | None = None
        self._writer_tried = 0.0
        self._reader = ThreadPoolExecutor(1, "parashift-kv-read") if disk is not None else None
        self.remote: RemoteTier | None = None  # pools over nodes: the head node's KV server
        self.jobs: dict[int, _Job] = {}
        self._free_ids = list(range(MAX_JOBS - 1, -1, -1))
        self._loading: dict[int, int] = {}  # block hash -> the job loading it
        self._stored: dict[str, int] = {}  # request id -> its blocks considered for storing
        self._emitted: list[KVTransferJob] = []
        # Loaded blocks a load's requests will find as prefix hits, held until each is
        # admitted or gone (freed, they could be evicted before): blocks -> their requests.
        self._held: list[tuple[list[KVCacheBlock], list[Request]]] = []
        self.stats = KVTierStats()
        self._try_disk_writer()

    # --- loads ------------------------------------------------------------------------------
    def begin_load(self, request: Request, hits: list[KVCacheBlock]) -> LoadStart:
        if request.kv_load_tried:
            return LoadStart.NONE
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[len(hits):max_blocks]
        if not hashes:
            return LoadStart.NONE
        loading = self._loading.get(hashes[0])
        if loading is not None:  # its next block is on its way for another request
            self.jobs[loading].waiters.append(request)
            return LoadStart.WAIT
        started = time.monotonic()
        keys = [tier_key(self.identity, h) for h in hashes]
        slots = self.arena.lookup(keys)
        read_slots = self._reserve_reads(keys[len(slots):]) if self.disk is not None else []
        # A request continued from a prefill rank on the head node: the blocks this node lacks
        # are on the head's.
        remote = (not read_slots and self.remote is not None and bool(request.output_token_ids)
                  and len(slots) < len(keys))
        if remote:
            read_slots = self._reserve_run(keys[len(slots):])
        num = len(slots) + len(read_slots)
        if not num:
            return LoadStart.NONE
        blocks = self._allocate(hits, num) if self._free_ids else None
        if blocks is None:  # no room: it computes them
            self.arena.unpin(slots)
            self.arena.abandon(read_slots)
            return LoadStart.NONE
        request.kv_load_tried = True
        job = _Job(self._free_ids.pop(), True, blocks, hashes[:num], slots + read_slots,
                   num_host=len(slots), remote=remote, started=started)
        self.jobs[job.id] = job
        if not read_slots:  # loaded before this step's forward: a prefix hit already
            for block, block_hash in zip(blocks, job.hashes, strict=True):
                self.pool.cache(block, block_hash)
            self._emit(job)
            return LoadStart.NOW
        job.waiters.append(request)
        for block_hash in job.hashes:
            self._loading[block_hash] = job.id
        if remote:
            job.reading = self._reader.submit(self.remote.fetch, keys[len(slots):num],
                                              self.arena, read_slots)
        else:
            reads = list(zip(keys[len(slots):num], read_slots, strict=True))
            job.reading = self._reader.submit(self._read, reads)
        return LoadStart.WAIT

    def _reserve_reads(self, keys: list[int]) -> list[int]:
        """Arena slots for the run of `keys` the disk holds, to read them into."""
        on_disk = []
        for key in keys:
            if not self.disk.contains(key):
                break
            on_disk.append(key)
        return self._reserve_run(on_disk)

    def _reserve_run(self, keys: list[int]) -> list[int]:
        """Arena slots for `keys`, up to the first that cannot have one."""
        reserved = self.arena.reserve(keys) if keys else []
        cut = next((i for i, slot in enumerate(reserved) if slot is None), len(reserved))
        self.arena.abandon([slot for slot in reserved[cut:] if slot is not None])
        return reserved[:cut]

    def _allocate(self, hits: list[KVCacheBlock], num: int) -> list[KVCacheBlock] | None:
        """`num` blocks of the pool, leaving the request's hits cached and an eighth of the
        pool free for the running requests to grow into; None without room (it computes)."""
        pool = self.pool
        pool.touch(hits)  # not evicted for the blocks they precede
        try:
            if pool.num_free_blocks < num + max(1, pool.num_blocks // 8):
                return None
            return pool.allocate(num)
        finally:
            pool.free(hits)

    def _read(self, reads: list[tuple[int, int]]) -> int:
        """In the reader thread: how many of the blocks, from the first, read intact."""
        for done, (key, slot) in enumerate(reads):
            if not self.disk.read_into(key, self.arena.slot(slot)):
                return done
        return len(reads)

    # --- stores -----------------------------------------------------------------------------
    def store(self, request: Request) -> None:
        """Its blocks this step filled (write-through): prompt blocks, and with `store_decode`
        the generated tokens' too."""
        req_id = request.request_id
        upto = self.kv_cache.num_cached_blocks.get(req_id, 0)
        if not self.store_decode:
            upto = min(upto, request.num_prompt_tokens // self.block_size)
        start = self._stored.get(req_id, 0)
        if upto <= start or not self._free_ids:  # (no job free: tried again next step)
            return
        self._stored[req_id] = upto
        blocks = self.kv_cache.req_blocks[req_id][start:upto]
        hashes = request.block_hashes[start:upto]
        slots = self.arena.reserve([tier_key(self.identity, h) for h in hashes])
        kept = [(b, h, s) for b, h, s in zip(blocks, hashes, slots, strict=True)
                if s is not None]
        if not kept:
            return
        held = [b for b, _, _ in kept]
        self.pool.touch(held)  # not reused before the copy is out
        # A prefill pool's request that samples its first token in this step: its decode
        # rank waits for these blocks.
        urgent = request.hands_off and request.num_computed_tokens >= request.num_tokens
        job = _Job(self._free_ids.pop(), False, held, [h for _, h, _ in kept],
                   [s for _, _, s in kept], owner=req_id, urgent=urgent)
        self.jobs[job.id] = job
        self._emit(job)

    # --- the step ---------------------------------------------------------------------------
    def _emit(self, job: _Job) -> None:
        self.board.start(job.id)
        self._emitted.append(KVTransferJob(job.id, job.load, [b.block_id for b in job.blocks],
                                           list(job.slots), job.urgent))

    def take_jobs(self) -> list[KVTransferJob]:
        jobs, self._emitted = self._emitted, []
        return jobs

    def settle(self) -> list[Request]:
        """Ends the jobs that are done; returns the requests whose loads ended."""
        if not time.monotonic() - self._writer_tried < _WRITER_RETRY_S:
            self._try_disk_writer()
        ready: list[Request] = []
        for job in list(self.jobs.values()):
            if job.reading is not None:
                if job.reading.done():
                    self._read_done(job, ready)
                continue
            outcome = self.board.outcome(job.id)
            if outcome != PENDING:
                self._end(job, outcome == DONE, ready)
        return ready

    def _read_done(self, job: _Job, ready: list[Request]) -> None:
        """Its disk reads are in: the intact ones are published (pinned for the load), the
        rest and their blocks dropped."""
        job.reading, num_read = None, job.reading.result()
        reads = job.slots[job.num_host:]
        self.arena.publish(reads[:num_read], persisted=not job.remote, pin=True)
        self.arena.abandon(reads[num_read:])
        keep = job.num_host + num_read
        job.num_read = num_read
        for block_hash in job.hashes[keep:]:
            self._loading.pop(block_hash, None)
        self.pool.free(job.blocks[keep:])
        del job.blocks[keep:], job.hashes[keep:], job.slots[keep:]
        if job.blocks:
            self._emit(job)
        else:
            self._end(job, False, ready)

    def _end(self, job: _Job, ok: bool, ready: list[Request]) -> None:
        del self.jobs[job.id]
        self._free_ids.append(job.id)
        if job.load:
            if ok:
                for block, block_hash in zip(job.blocks, job.hashes, strict=True):
                    self.pool.cache(block, block_hash)
                self._count_load(job)
            else:
                self.stats.failed_loads += 1
            self.arena.unpin(job.slots)
            for block_hash in job.hashes:
                self._loading.pop(block_hash, None)
            ready.extend(job.waiters)
            if ok and job.waiters:
                self._held.append((job.blocks, list(job.waiters)))
                return
        elif ok:
            self.arena.publish(job.slots)
            self.stats.stored_bytes += len(job.slots) * self.block_bytes
            if self._writer is not None:
                self._writer.wake()
        else:
            self.arena.abandon(job.slots)
        self.pool.free(job.blocks)

    def _count_load(self, job: _Job) -> None:
        stats, seconds = self.stats, time.monotonic() - job.started
        stats.host_hit_blocks += job.num_host
        stats.loaded_bytes += len(job.blocks) * self.block_bytes
        if job.remote:
            stats.remote_hit_blocks += job.num_read
            stats.remote_loads += 1
            stats.remote_load_seconds += seconds
            return
        stats.disk_hit_blocks += job.num_read
        if job.num_read:
            stats.disk_loads += 1
            stats.disk_load_seconds += seconds
        else:
            stats.host_loads += 1
            stats.host_load_seconds += seconds

    def release(self, request: Request) -> None:
        """The request was admitted (its own references on the loaded blocks taken) or is
        gone: the load's hold on them ends with its last request."""
        for held in [h for h in self._held if request in h[1]]:
            held[1].remove(request)
            if not held[1]:
                self._held.remove(held)
                self.pool.free(held[0])

    def storing(self, request_id: str) -> bool:
        """Stores of the request's blocks are still copying (those that ended are settled
        here: a hand-off need not wait for the next step's `settle`)."""
        for job in [j for j in self.jobs.values() if j.owner == request_id]:
            outcome = self.board.outcome(job.id)
            if outcome != PENDING:
                self._end(job, outcome == DONE, [])
        return any(job.owner == request_id for job in self.jobs.values())

    def forget(self, request: Request) -> None:
        self._stored.pop(request.request_id, None)
        self.release(request)
        for job in self.jobs.values():
            if request in job.waiters:
                job.waiters.remove(request)

    @property
    def busy(self) -> bool:
        return bool(self.jobs)

    # --- the node's disk writer ---------------------------------------------------------------
    def _try_disk_writer(self) -> None:
        """Becomes the node's disk writer if none is (the lock of a writer that died is free)."""
        self._writer_tried = time.monotonic()
        folder, size = self._disk_args
        if self.disk is None or self._writer is not None or folder is None:
            return
        from parashift.kv_tiers.disk_tier import DiskTier
        from parashift.kv_tiers.disk_writer import DiskWriter

        fd = None
        try:
            fd = os.open(os.path.join(folder, ".writer.lock"),
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            tier = DiskTier(folder, size, self.identity, self.arena.slot_bytes, writer=True)
        except BlockingIOError:  # another engine of the node writes
            os.close(fd)
            return
        except (OSError, ValueError) as e:  # the folder went or changed: reads go on
            logger.warning("KV disk tier: cannot write %s (%s); blocks are kept in memory "
                           "only", folder, e)
            if fd is not None:
                os.close(fd)
            self._disk_args = (None, 0)
            return
        self._writer_lock = fd
        self._writer = DiskWriter(tier, self.arena)
        self._writer.start()
        logger.info("KV disk tier: this engine writes %s (%d blocks held)", folder,
                    tier.num_blocks())

    def attach_remote(self, remote: RemoteTier) -> None:
        """Pools over nodes: fetch from the head node's KV server what this node lacks."""
        self.remote = remote
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, "parashift-kv-read")

    def stop_disk_writer(self) -> None:
        """The background writer stops after its batch (whose pins go with it); `close`
        still persists what the arena holds."""
        if self._writer is not None:
            self._writer.stop()

    def close(self) -> None:
        if self._writer is not None:
            self.stop_disk_writer()
            while self._writer.persist_batch()[0]:  # what the arena holds, for a restart
                pass
        if self._writer_lock is not None:
            os.close(self._writer_lock)
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        if self.remote is not None:
            self.remote.close()
        for job in self.jobs.values():  # (after a bounded drain: what did not end)
            if job.load:  # its pins and unread slots go; a store's copy may still write
                self.arena.unpin(job.slots[:job.num_host])
                rest = job.slots[job.num_host:]
                self.arena.abandon(rest) if job.reading is not None else self.arena.unpin(rest)
        with contextlib.suppress(Exception):
            self.board.close()
        self.arena.close()

"""A worker's side of KV transfers: copies between its KV cache and the node's host arena, on
a copy thread of its own, reported on the engine's job board when done.

A slot holds one block of every worker of the engine, worker w's share at w x worker_bytes:
per layer, its K block then its V block, as the cache holds them. Loads run in the worker's
own thread before the step's forward, which may read their blocks: the scheduler admits a
request in the step that loads its blocks, so a load costs the step a copy (about 10 ms for
20 MB) instead of costing the request a step's wait. Stores are queued after the forward
(it wrote the blocks they read; the scheduler holds those blocks until the store is
reported) and run on a copy thread. On CPU the copies run in numpy, which releases the GIL
and starts no OpenMP team beside the forward's; on GPU a load copies in stream order and a
store on a side stream that waits for the forward."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from parashift.kv_tiers.host_arena import HostArena
from parashift.kv_tiers.job_board import JobBoard
from parashift.types.outputs import KVTransferJob

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierLink:
    """What a worker needs to reach its engine's tiers (the engine sends it once)."""

    arena_path: str
    slot_bytes: int
    board_path: str
    num_jobs: int
    num_workers: int
    worker_bytes: int


def _as_words(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy (16-bit dtypes as int16: numpy has no bfloat16)."""
    width = t.element_size()
    words = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    return t.view(words).numpy()


class KVTransfers:
    def __init__(self, link: TierLink, worker: int,
                 kv: list[tuple[torch.Tensor, torch.Tensor]]):
        self.worker = worker
        k0 = kv[0][0]
        per_block = k0[0].numel()  # block_size x kv heads x head dim
        if 2 * len(kv) * per_block * k0.element_size() > link.worker_bytes:
            raise ValueError("the KV host tier's slots do not match this worker's cache")
        # mapped after the check: a refused cache leaves no descriptor or mapping open
        self.arena = HostArena.attach(link.arena_path, link.slot_bytes)
        self.board = JobBoard(link.board_path, link.num_jobs, link.num_workers, owner=False)
        self.device = k0.device
        words = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[k0.element_size()]
        item = np.dtype(words).itemsize
        # (slot, layer, K/V, a block's values): a view of the arena, never a copy
        self.slots = np.ndarray(
            (self.arena.num_slots, len(kv), 2, per_block), dtype=words, buffer=self.arena.data(),
            offset=worker * link.worker_bytes,
            strides=(self.arena.slot_stride, 2 * per_block * item, per_block * item, item))
        self.kv = kv
        self.cache = ([(_as_words(k), _as_words(v)) for k, v in kv]
                      if self.device.type == "cpu" else None)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._jobs: queue.SimpleQueue[tuple[KVTransferJob, torch.cuda.Event | None] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name="parashift-kv-copy", daemon=True)
        self._thread.start()

    def before_forward(self, jobs: list[KVTransferJob]) -> None:
        """Loads, done before the forward returns to its caller. A load that fails fails the
        step: its blocks hold no valid KV and a request of this step may read them."""
        for job in jobs:
            if job.load:
                if self.cache is not None:
                    self._copy_cpu(job)
                else:
                    self._load_cuda(job)
                self.board.report(job.job, self.worker, True)

    def after_forward(self, jobs: list[KVTransferJob]) -> None:
        """Stores: queued after this step's forward wrote their blocks (urgent ones copied
        here, before the step's result returns)."""
        stores = [job for job in jobs if not job.load]
        if not stores:
            return
        event = None
        if self.stream is not None:  # the forward's writes, in stream order
            event = torch.cuda.Event()
            event.record()
        for job in stores:
            if job.urgent:
                self._store(job, event)
            else:
                self._jobs.put((job, event))

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            self._store(*item)

    def _store(self, job: KVTransferJob, event: torch.cuda.Event | None) -> None:
        try:
            if self.cache is not None:
                self._copy_cpu(job)
            else:
                self._copy_cuda(job, event)
            ok = True
        except Exception:  # the job fails alone; the engine recomputes its blocks
            logger.exception("KV store of %d blocks failed", len(job.block_ids))
            ok = False
        self.board.report(job.job, self.worker, ok)

    def _copy_cpu(self, job: KVTransferJob) -> None:
        blocks, slots = np.asarray(job.block_ids), np.asarray(job.slots)
        n = len(blocks)
        for layer, (k, v) in enumerate(self.cache):
            for half, cache in ((0, k), (1, v)):
                if job.load:
                    cache[blocks] = self.slots[slots, layer, half].reshape(n, *cache.shape[1:])
                else:
                    self.slots[slots, layer, half] = cache[blocks].reshape(n, -1)

    def _load_cuda(self, job: KVTransferJob) -> None:
        """On the compute stream, after whatever it ran before (a step in flight may still
        write a block its request freed and this load fills)."""
        blocks = torch.tensor(job.block_ids, device=self.device)
        slots = np.asarray(job.slots)
        for layer, pair in enumerate(self.kv):
            for half, cache in enumerate(pair):
                host = torch.from_numpy(self.slots[slots, layer, half])  # (a copy: pageable)
                src = host.view(cache.dtype).to(self.device)
                cache.index_copy_(0, blocks, src.view(len(slots), *cache.shape[1:]))

    def _copy_cuda(self, job: KVTransferJob, event: torch.cuda.Event | None) -> None:
        """A store, on the side stream once the forward's writes are done."""
        slots = np.asarray(job.slots)
        with torch.cuda.stream(self.stream):
            if event is not None:
                self.stream.wait_event(event)
            blocks = torch.tensor(job.block_ids, device=self.device)
            for layer, pair in enumerate(self.kv):
                for half, cache in enumerate(pair):
                    out = cache.index_select(0, blocks).reshape(len(slots), -1).cpu()
                    self.slots[slots, layer, half] = _as_words(out)
            self.stream.synchronize()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self.slots = self.cache = None
        self.board.close()
        self.arena.close()

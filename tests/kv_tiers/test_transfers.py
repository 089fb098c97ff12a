"""A worker's KV copy thread on CPU, with real torch tensors, a real arena in /dev/shm and a job
board: stored blocks load back bitwise (float32, bfloat16); two workers fill their own shares
of the same slot; a failed job is reported FAILED and later jobs are still served."""

from __future__ import annotations

import glob
import os
import time
import uuid

import pytest
import torch

from parashift.kv_tiers.host_arena import WAYS, HostArena
from parashift.kv_tiers.job_board import DONE, FAILED, PENDING, JobBoard
from parashift.kv_tiers.shm_files import shm_path
from parashift.kv_tiers.transfers import KVTransfers, TierLink
from parashift.types.outputs import KVTransferJob

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 8, 4, 2, 8
NUM_JOBS = 8
HANG_GUARD_S = 60  # only against a hang: every wait ends on the board's event


def worker_bytes(dtype: torch.dtype) -> int:
    return 2 * NUM_LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * dtype.itemsize


def make_cache(dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(NUM_LAYERS)]


def block_bytes(kv: list[tuple[torch.Tensor, torch.Tensor]], block: int) -> bytes:
    """A worker's share of a slot: per layer, its K block then its V block."""
    return b"".join(t[block].contiguous().view(torch.uint8).numpy().tobytes()
                    for pair in kv for t in pair)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class Tiers:
    """The engine's side: the arena (its owner) and the job board, for `num_workers`."""

    def __init__(self, dtype: torch.dtype, num_workers: int):
        self.worker_bytes = worker_bytes(dtype)
        slot_bytes = num_workers * self.worker_bytes
        self.path = shm_path(f"parashift-test-transfers-{uuid.uuid4().hex}")
        self.arena = HostArena.open(self.path, HostArena.file_bytes(WAYS, slot_bytes),
                                    slot_bytes, owner=True)
        self.board = JobBoard.create(NUM_JOBS, num_workers)
        self.link = TierLink(self.path, slot_bytes, self.board.path, NUM_JOBS, num_workers,
                             self.worker_bytes)
        self.next_job = 0

    def job(self, load: bool, block_ids: list[int], slots: list[int]) -> KVTransferJob:
        job = self.next_job
        self.next_job += 1
        self.board.start(job)
        return KVTransferJob(job, load, block_ids, slots)

    def wait(self, job: KVTransferJob) -> int:
        deadline = time.monotonic() + HANG_GUARD_S
        while (outcome := self.board.outcome(job.job)) == PENDING:
            if time.monotonic() > deadline:
                pytest.fail(f"job {job.job} still pending after {HANG_GUARD_S} s")
            time.sleep(0.001)
        return outcome

    def close(self) -> None:
        paths = [self.path, self.board.path]
        self.board.close()
        self.arena.close()
        assert not [p for p in paths if os.path.exists(p)]
        assert not glob.glob(self.path + "*")


@pytest.fixture
def tiers_factory():
    made: list[Tiers] = []

    def make(dtype: torch.dtype, num_workers: int = 1) -> Tiers:
        made.append(Tiers(dtype, num_workers))
        return made[-1]

    yield make
    for tiers in made:
        tiers.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_blocks_load_back_bitwise(tiers_factory, dtype):
    tiers = tiers_factory(dtype)
    kv = make_cache(dtype, seed=0)
    original = [(k.clone(), v.clone()) for k, v in kv]
    worker = KVTransfers(tiers.link, 0, kv)
    slots = tiers.arena.reserve([101, 102])
    store = tiers.job(load=False, block_ids=[1, 3], slots=slots)
    worker.after_forward([store])
    assert tiers.wait(store) == DONE
    tiers.arena.publish(slots)
    for slot, block in zip(slots, [1, 3], strict=True):
        assert bytes(tiers.arena.slot(slot)) == block_bytes(original, block)

    found = tiers.arena.lookup([101, 102])
    load = tiers.job(load=True, block_ids=[6, 5], slots=found)
    worker.before_forward([load])
    assert tiers.wait(load) == DONE
    tiers.arena.unpin(found)
    for (k, v), (k0, v0) in zip(kv, original, strict=True):
        for got, want in ((6, 1), (5, 3)):
            assert bitwise_equal(k[got], k0[want]) and bitwise_equal(v[got], v0[want])
        for untouched in (0, 1, 2, 3, 4, 7):
            assert bitwise_equal(k[untouched], k0[untouched])
            assert bitwise_equal(v[untouched], v0[untouched])
    worker.close()


def test_each_hook_takes_its_own_kind_of_job(tiers_factory):
    """A load handed after the forward, or a store before it, is not run: the queue is served
    in order, so the job queued after it is done and it is still pending."""
    tiers = tiers_factory(torch.float32)
    kv = make_cache(torch.float32, seed=1)
    worker = KVTransfers(tiers.link, 0, kv)
    slots = tiers.arena.reserve([7])
    misplaced_load = tiers.job(load=True, block_ids=[0], slots=slots)
    misplaced_store = tiers.job(load=False, block_ids=[0], slots=slots)
    worker.after_forward([misplaced_load])
    worker.before_forward([misplaced_store])
    store = tiers.job(load=False, block_ids=[2], slots=slots)
    worker.after_forward([misplaced_load, store])
    assert tiers.wait(store) == DONE
    assert tiers.board.outcome(misplaced_load.job) == PENDING
    assert tiers.board.outcome(misplaced_store.job) == PENDING
    assert bytes(tiers.arena.slot(slots[0])) == block_bytes(kv, 2)
    worker.close()


def test_two_workers_fill_their_own_shares_of_a_slot(tiers_factory):
    tiers = tiers_factory(torch.bfloat16, num_workers=2)
    caches = [make_cache(torch.bfloat16, seed=10 + w) for w in range(2)]
    originals = [[(k.clone(), v.clone()) for k, v in kv] for kv in caches]
    workers = [KVTransfers(tiers.link, w, kv) for w, kv in enumerate(caches)]
    slots = tiers.arena.reserve([1, 2])
    store = tiers.job(load=False, block_ids=[4, 0], slots=slots)
    workers[1].after_forward([store])
    workers[0].after_forward([store])
    assert tiers.wait(store) == DONE  # both reported
    tiers.arena.publish(slots)
    share = tiers.worker_bytes
    for slot, block in zip(slots, [4, 0], strict=True):
        data = bytes(tiers.arena.slot(slot))
        assert len(data) == 2 * share
        assert data[:share] == block_bytes(originals[0], block)
        assert data[share:] == block_bytes(originals[1], block)

    load = tiers.job(load=True, block_ids=[7, 6], slots=slots)
    for worker in workers:
        worker.before_forward([load])
    assert tiers.wait(load) == DONE
    for kv, original in zip(caches, originals, strict=True):
        for (k, v), (k0, v0) in zip(kv, original, strict=True):
            assert bitwise_equal(k[7], k0[4]) and bitwise_equal(v[6], v0[0])
    for worker in workers:
        worker.close()


def test_a_failed_store_is_reported_a_failed_load_raises_later_jobs_run(tiers_factory, caplog):
    tiers = tiers_factory(torch.float32)
    kv = make_cache(torch.float32, seed=2)
    worker = KVTransfers(tiers.link, 0, kv)
    slots = tiers.arena.reserve([5])
    bad_store = tiers.job(load=False, block_ids=[NUM_BLOCKS], slots=slots)
    worker.after_forward([bad_store])
    assert tiers.wait(bad_store) == FAILED
    bad_load = tiers.job(load=True, block_ids=[NUM_BLOCKS + 3], slots=slots)
    bad_slot = tiers.job(load=False, block_ids=[0], slots=[tiers.arena.num_slots])
    with pytest.raises(IndexError):  # a load fails its step: its blocks hold no valid KV
        worker.before_forward([bad_load])
    assert tiers.board.outcome(bad_load.job) == PENDING
    worker.after_forward([bad_slot])
    assert tiers.wait(bad_slot) == FAILED
    assert "KV store of 1 blocks failed" in caplog.text

    store = tiers.job(load=False, block_ids=[3], slots=slots)
    worker.after_forward([store])
    assert tiers.wait(store) == DONE
    assert bytes(tiers.arena.slot(slots[0])) == block_bytes(kv, 3)
    worker.close()


def test_close_joins_the_copy_thread(tiers_factory):
    tiers = tiers_factory(torch.float32)
    worker = KVTransfers(tiers.link, 0, make_cache(torch.float32, seed=3))
    thread = worker._thread
    assert thread.is_alive() and thread.name == "parashift-kv-copy"
    slots = tiers.arena.reserve([9])
    store = tiers.job(load=False, block_ids=[1], slots=slots)
    worker.after_forward([store])
    worker.close()  # the queued store first, then the thread ends
    assert not thread.is_alive()
    assert tiers.board.outcome(store.job) == DONE


def test_a_cache_larger_than_the_slots_is_refused(tiers_factory):
    tiers = tiers_factory(torch.float32)
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match="do not match this worker's cache"):
        KVTransfers(tiers.link, 0, make_cache(torch.float32, seed=4) * 2)
    assert set(os.listdir("/proc/self/fd")) == fds  # the arena was not left attached

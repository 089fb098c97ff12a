"""Where an engine's workers report its KV transfers done: a shared-memory table, a row per
transfer job and a byte per worker. The engine polls it between steps (the scheduler never
waits on a copy); a worker's copy thread sets its byte when its share of a job is copied."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import weakref

import numpy as np

PENDING, DONE, FAILED = 0, 1, 2


class JobBoard:
    def __init__(self, path: str, num_jobs: int, num_workers: int, owner: bool):
        self.path, self.num_jobs, self.num_workers, self.owner = (path, num_jobs, num_workers,
                                                                  owner)
        self._unlink = weakref.finalize(self, _remove, path) if owner else None  # at exit too
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self._map = mmap.mmap(fd, num_jobs * num_workers)
        finally:
            os.close(fd)
        self.flags = np.frombuffer(self._map, dtype=np.uint8).reshape(num_jobs, num_workers)

    @classmethod
    def create(cls, num_jobs: int, num_workers: int) -> JobBoard:
        # 0600, a fresh name (O_EXCL)
        fd, path = tempfile.mkstemp(prefix="parashift-kv-jobs-", dir="/dev/shm")  # nosec B108
        try:
            os.ftruncate(fd, num_jobs * num_workers)
        finally:
            os.close(fd)
        return cls(path, num_jobs, num_workers, owner=True)

    def start(self, job: int) -> None:
        self.flags[job] = PENDING

    def report(self, job: int, worker: int, ok: bool) -> None:
        self.flags[job, worker] = DONE if ok else FAILED

    def outcome(self, job: int) -> int:
        """PENDING until every worker reported; then DONE, or FAILED if any worker failed."""
        row = self.flags[job]
        if (row == PENDING).any():
            return PENDING
        return FAILED if (row == FAILED).any() else DONE

    def close(self) -> None:
        self.flags = None
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._unlink is not None:
            self._unlink()


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)

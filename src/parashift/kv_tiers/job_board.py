"""Where an engine's workers report its KV transfers done: a shared-memory table, a row per
transfer job and a byte per worker. The engine polls it between steps (the scheduler never
waits on a copy); a worker's copy thread sets its byte when its share of a job is copied.

The engine that makes a board unlinks it when it closes or exits. One that is killed cannot:
the board is named after its pid (shm_files.board_path) and held while it lives
(shm_files.hold), so that its launcher removes it when it reaps the engine, and any later
launch's sweep if that launcher was killed too."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref

import numpy as np

from parashift.kv_tiers.shm_files import board_path, hold

PENDING, DONE, FAILED = 0, 1, 2


class JobBoard:
    def __init__(self, path: str, num_jobs: int, num_workers: int, owner: bool):
        self.path, self.num_jobs, self.num_workers, self.owner = (path, num_jobs, num_workers,
                                                                  owner)
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self._map = mmap.mmap(fd, num_jobs * num_workers)
        except BaseException:
            os.close(fd)
            raise
        if owner:  # held (the sweep's sign of life) until closed, unlinked at exit too
            hold(fd)
            self._unlink = weakref.finalize(self, _remove, path, fd)
        else:
            os.close(fd)
            self._unlink = None
        self.flags = np.frombuffer(self._map, dtype=np.uint8).reshape(num_jobs, num_workers)

    @classmethod
    def create(cls, num_jobs: int, num_workers: int) -> JobBoard:
        path = board_path(secrets.token_hex(8))
        # 0600, a fresh name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, num_jobs * num_workers)
            return cls(path, num_jobs, num_workers, owner=True)
        except BaseException:  # (a full /dev/shm) nothing else would remove it
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)

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


def _remove(path: str, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)

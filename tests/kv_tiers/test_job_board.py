"""The job board an engine's workers report their KV copies on (kv_tiers/job_board.py): a job
is pending until every worker reported, failed if any failed; the owner unlinks it at close;
a killed engine's board goes when its launcher reaps it, a live one's stays."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from parashift.kv_tiers.job_board import DONE, FAILED, PENDING, JobBoard
from parashift.kv_tiers.shm_files import sweep_boards_of


def test_job_board_is_pending_until_every_worker_reported():
    board = JobBoard.create(num_jobs=4, num_workers=3)
    assert board.path.startswith("/dev/shm/") and os.stat(board.path).st_mode & 0o777 == 0o600
    worker_view = JobBoard(board.path, 4, 3, owner=False)
    board.start(1)
    assert board.outcome(1) == PENDING
    worker_view.report(1, 0, ok=True)
    worker_view.report(1, 2, ok=True)
    assert board.outcome(1) == PENDING
    worker_view.report(1, 1, ok=True)
    assert board.outcome(1) == DONE
    board.start(2)
    for worker, ok in ((0, True), (1, False)):
        worker_view.report(2, worker, ok)
    assert board.outcome(2) == PENDING
    worker_view.report(2, 2, ok=True)
    assert board.outcome(2) == FAILED
    board.start(1)  # the row is used again
    assert board.outcome(1) == PENDING and board.outcome(2) == FAILED
    worker_view.close()
    assert os.path.exists(board.path)
    board.close()
    assert not os.path.exists(board.path)


BOARD_HOLDER = """
import sys

import pytest
from parashift.kv_tiers.job_board import JobBoard
board = JobBoard.create(num_jobs=4, num_workers=2)
print(board.path, flush=True)
sys.stdin.read()
"""


def test_a_killed_engines_job_board_goes_when_it_is_reaped_a_live_ones_stays():
    """A board is named after its engine's pid and held while the engine lives: a SIGKILLed
    engine's board (it could not unlink it) goes when its launcher reaps it
    (`sweep_boards_of`), and a live engine's board stays, whoever sweeps."""
    engines = [subprocess.Popen([sys.executable, "-c", BOARD_HOLDER],  # nosec
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        paths = [engine.stdout.readline().strip() for engine in engines]
        for engine, path in zip(engines, paths, strict=True):
            assert os.path.basename(path).startswith(f"parashift-kv-jobs-{engine.pid}-")
        assert sweep_boards_of(engines[1].pid) == []  # alive: held
        engines[0].kill()
        engines[0].wait()
        assert os.path.exists(paths[0])
        assert sweep_boards_of(engines[1].pid) == []  # another engine's board
        assert sweep_boards_of(engines[0].pid) == [(paths[0], 8)]
        assert not os.path.exists(paths[0]) and os.path.exists(paths[1])
    finally:
        for engine in engines:
            engine.kill()
            engine.wait()
    sweep_boards_of(engines[1].pid)
    assert not os.path.exists(paths[1])


def test_a_board_whose_set_up_fails_is_not_left(monkeypatch):
    """A full /dev/shm fails a board's set-up after its file exists: the file goes with the
    error, not at the next launch's sweep."""
    def full(fd: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    mine = f"parashift-kv-jobs-{os.getpid()}-"
    before = {n for n in os.listdir("/dev/shm") if n.startswith(mine)}
    monkeypatch.setattr(os, "ftruncate", full)
    with pytest.raises(OSError, match="No space"):
        JobBoard.create(num_jobs=4, num_workers=2)
    assert {n for n in os.listdir("/dev/shm") if n.startswith(mine)} == before

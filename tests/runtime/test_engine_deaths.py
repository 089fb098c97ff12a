"""The launcher's record of its engines' deaths (runtime/local_engines.py): a reaped engine's
death is recorded whatever becomes of the clean-up after it."""

import multiprocessing

from parashift.kv_tiers import shm_files
from parashift.runtime.local_engines import LocalEngines


def test_a_death_is_recorded_when_its_job_boards_cannot_be_swept(monkeypatch, caplog):
    def unreadable(pid: int) -> list:
        raise PermissionError(13, "Permission denied", "/dev/shm")

    monkeypatch.setattr(shm_files, "sweep_boards_of", unreadable)
    engines = LocalEngines({}, "ipc:///nowhere", "info", 10.0)
    proc = multiprocessing.get_context("spawn").Process(target=int)
    proc.start()
    proc.join(30)
    engines.procs[3] = proc
    deaths = engines.reap()
    assert [(d.rank, d.pid) for d in deaths] == [(3, proc.pid)]
    assert "exited with code 0" in deaths[0].reason
    assert engines.procs == {}
    assert f"could not sweep the KV job boards of engine pid {proc.pid}" in caplog.text

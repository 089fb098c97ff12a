"""The host tiers' files in /dev/shm: their names, the lock by which every process that maps
one says it is alive, and the sweep of the files that killed launches left (kv_tiers/host_arena.py
maps them)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
import struct
import time

logger = logging.getLogger(__name__)

SHM_FOLDER = "/dev/shm"  # nosec B108: shared memory; files O_EXCL or O_NOFOLLOW, and 0600


def shm_path(name: str) -> str:
    return os.path.join(SHM_FOLDER, name)


def node_arena_path(token: str) -> str:
    """The name a launch gives its node's arena (its engines make it; it removes it)."""
    return shm_path(f"parashift-kv-{os.getpid()}-{token}")


def board_path(token: str, pid: int | None = None) -> str:
    """An engine's KV job board (kv_tiers/job_board.py), named after the engine's pid."""
    return shm_path(f"parashift-kv-jobs-{pid or os.getpid()}-{token}")


def headless_arena_path(head_arena: str) -> str:
    """The arena of a headless node's engines: named after the head's, told apart from it
    (two process trees on one machine are two nodes)."""
    return f"{head_arena}-node"


# struct flock (Linux, 64-bit): type, whence, start, length, pid (0 for a file-description lock)
FLOCK = struct.Struct("hhxxxxqqi4x")
# the names node_arena_path and the engines give arenas, their temporary names while made, and
# the engines' job boards (board_path)
_TIER_FILE = re.compile(r"parashift-kv-(\d+-[0-9a-f]+(\.\d+\.\d+)?|jobs-\d+-[0-9a-f]+)")


def hold(fd: int) -> None:
    """A read lock on the file's first byte for as long as this open file lives: an open file
    description lock, which the kernel drops when the last process holding it dies, in any PID
    namespace (independent of the index's flock). `sweep` takes only files nobody holds."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 1, 0))


def sweep(folder: str = SHM_FOLDER, min_age_s: float = 60.0,
          names: re.Pattern = _TIER_FILE) -> list[tuple[str, int]]:
    """Remove the arenas and job boards that processes killed before their exit handlers ran
    (SIGKILL, the OOM killer) left in `folder`: this user's regular files named as `names`,
    older than `min_age_s` (a file being made takes its lock just after it is created), that no
    process holds (`hold`). Returns what went, with its bytes."""
    removed = []
    for name in sorted(os.listdir(folder)):
        if not names.fullmatch(name):
            continue
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone, a link, not ours
            continue
        try:
            st = os.fstat(fd)
            if (st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode)
                    or time.time() - st.st_ctime < min_age_s):
                continue
            try:  # while it is held for writing here, nobody maps it
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK,
                            FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
            except OSError:  # a live process holds it
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append((path, st.st_size))
                logger.warning("removed %s (%.1f MiB): a KV tier file a killed process left",
                               path, st.st_size / 2**20)
        finally:
            os.close(fd)
    return removed


def sweep_boards_of(pid: int, folder: str = SHM_FOLDER) -> list[tuple[str, int]]:
    """The job boards of the engine `pid`, which its launcher has just reaped (a killed engine
    leaves its board): those nobody holds, at once."""
    return sweep(folder, 0.0, re.compile(re.escape(os.path.basename(board_path("", pid)))
                                         + "[0-9a-f]+"))


def remove(path: str | None) -> None:
    """The arena's name, at the end of the launch that named it (mappings live on)."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

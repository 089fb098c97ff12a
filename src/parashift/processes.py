"""What every child process of a launch does to start, name itself, find its launch folder
and end: the process lifecycle, apart from the sockets it talks through (wire/sockets.py)."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.forkserver
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NoReturn


def set_process_name(name: str) -> None:
    """So that `ps` tells what is running (parashift-engine-dp0, parashift-api-0)."""
    try:
        import setproctitle

        setproctitle.setproctitle(name)
    except ImportError:
        pass
    try:  # the kernel's short name too (ps -o comm, top)
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def die_with_parent() -> None:
    """Linux: get SIGTERM if the launcher dies without cleaning up (even by SIGKILL). A child
    of the launch's fork server (runtime/child_processes.py) has that server for parent, which
    exits once the launcher and its children have all closed its "alive" pipe: multiprocessing
    hands each child the pipe's write end (so that it could fork through the server too), and
    the server would then live as long as its children, and they, dying with it, as long as
    the server. None of ours uses it: closed here."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, 15, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGTERM
    except (OSError, AttributeError):
        pass
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def _ipc_folder(address: str) -> str | None:
    """The folder of an ipc:// address (a local launch's private folder); None for tcp."""
    return os.path.dirname(address[len("ipc://"):]) if address.startswith("ipc://") else None


def keep_temp_files_in_launch_folder(address: str) -> None:
    """In a child of a local launch (`address` one of its ipc:// endpoints): the folders it
    makes for itself (a multi-worker engine's sockets) go inside the launch's folder, which the
    launcher removes at its end, also after this process was killed and could not."""
    folder = _ipc_folder(address)
    if folder is not None and os.path.isdir(folder):
        tempfile.tempdir = folder


def remove_launch_folder(address: str) -> None:
    """For an API server at its end, which is the whole launch's end (the launcher stops when
    one exits): a launcher killed outright (SIGKILL) cannot remove its ipc folder, so its API
    servers do."""
    folder = _ipc_folder(address)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def setup_child_logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", force=True)


def exit_now(code: int) -> NoReturn:
    """End a process that has closed everything it owns without the interpreter's teardown,
    which spends about a second unloading torch and friends on every server stop."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_after(entry: Callable[..., Any], *args: Any) -> NoReturn:
    """multiprocessing target for a child that owns nothing but what `entry` closes: run it,
    then `exit_now` with its exit code. (Ray actors call the entry itself: their process is
    Ray's to end.)"""
    try:
        entry(*args)
    except SystemExit as e:
        exit_now(e.code if isinstance(e.code, int) else 1)
    exit_now(0)


def named_actor_class(base: type, process_name: str) -> type:
    """A subclass named for the process (parashift-worker-dp0-tp1 -> ParashiftWorkerDp0Tp1):
    Ray titles an actor's process after its class ("ray::ParashiftEngineDp1.run"), so that
    `ps` tells the ranks apart."""
    return type("".join(part.capitalize() for part in process_name.split("-")), (base,), {})


def join_within(procs: list, seconds: float) -> None:
    """Join processes (multiprocessing.Process) on one deadline for all of them, not one
    each."""
    deadline = time.monotonic() + seconds
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def status_bytes(field: str) -> int:
    """Linux: a memory field of this process's /proc/self/status (VmRSS, VmHWM), in bytes; 0
    where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0

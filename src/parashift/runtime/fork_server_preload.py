"""Imported first by a launch's fork server (runtime/child_processes.py), whose only code is
imports: it names the process, so that `ps` tells it from the launcher it was started by, and
removes the folder of the server's socket when the server ends.

multiprocessing makes that folder (`pymp-*` in the temp dir) for the launcher and removes it
in the launcher's interpreter teardown, which a launcher never reaches: it ends with `exit_now`
(processes.py), or is killed. The server outlives it (it exits once the launcher and every
child have closed its "alive" pipe) and ends through the interpreter's teardown, so it removes
the folder then. Its children leave through `os._exit`, never through this `atexit`."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import socket
import stat

from parashift.processes import set_process_name

_SERVER_SOCKET = re.compile(r".*/pymp-[^/]+/listener-[^/]+")


def server_socket_folder() -> str | None:
    """The folder of this process's listening multiprocessing socket (the fork server's), found
    among its open descriptors (Linux's /proc); None where there is none."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return None
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            with socket.socket(fileno=os.dup(fd)) as sock:
                name = sock.getsockname() if sock.family == socket.AF_UNIX else None
        except OSError:
            continue
        if isinstance(name, str) and _SERVER_SOCKET.fullmatch(name):
            return os.path.dirname(name)
    return None


def remove_socket_folder_at_exit() -> None:
    folder = server_socket_folder()
    if folder is not None:
        atexit.register(shutil.rmtree, folder, True)


set_process_name("parashift-forkserver")
remove_socket_folder_at_exit()

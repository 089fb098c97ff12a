"""Imported first by a launch's fork server (runtime/child_processes.py), whose only code is
imports: it names the process, so that `ps` tells it from the launcher it was started by."""

from parashift.processes import set_process_name

set_process_name("parashift-forkserver")

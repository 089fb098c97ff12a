"""The grammar compile process (engine/grammar_process.py, engine/grammar_worker.py), real
processes throughout: a compile past its time limit is killed (its process gone) and refused
within the limit while a simple constraint compiles beside it; one past its memory limit is
refused; a compile process that dies is started again and its lost compile is not remembered
as the constraint's failure; and nothing is left after a shutdown (a job sent after it
fails at once) or the owner's death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from parashift import StructuredOutputsParams
from parashift.engine.structured_output import Grammars

TIMEOUT_S = 2.0
# N optional string properties compile in time growing ~9x per doubling (19 s at 1,600 on
# the tiny vocabulary here): 3,200 would take minutes.
SLOW = StructuredOutputsParams(json={"type": "object", "properties": {
    f"p{i}": {"type": "string"} for i in range(3200)}})


@pytest.fixture(scope="module")
def grammars(tiny_llama):
    made = Grammars(tiny_llama, 320, timeout_s=TIMEOUT_S)
    made.compile_now(StructuredOutputsParams(regex="warm"))  # started and ready
    yield made
    made.shutdown()


def compile_children(warm_pid: int, timeout: float = 30.0) -> list[psutil.Process]:
    """The compile process's children once one has named itself."""
    deadline = time.monotonic() + timeout
    while not (children := [p for p in psutil.Process(warm_pid).children()
                            if "-compile" in " ".join(p.cmdline())]):
        assert time.monotonic() < deadline, "no compile started"
        time.sleep(0.01)
    return children


def test_a_slow_compile_is_killed_and_stalls_no_other(grammars):
    start = time.monotonic()
    slow = grammars.compile(SLOW)
    warm_pid = grammars.process.pid
    (child,) = compile_children(warm_pid)
    beside = time.monotonic()
    grammars.compile_now(StructuredOutputsParams(regex="beside-[0-9]+"))
    assert time.monotonic() - beside < 1.0
    with pytest.raises(ValueError, match=f"did not compile within {TIMEOUT_S:g} s"):
        slow.result(TIMEOUT_S + 30).check()
    assert time.monotonic() - start < TIMEOUT_S + 1.0  # (the limit counts from its fork)
    assert not psutil.pid_exists(child.pid)  # killed and reaped: no CPU burned after
    after = time.monotonic()
    grammars.compile_now(StructuredOutputsParams(json={"type": "object", "properties": {
        "name": {"type": "string"}}}))
    assert time.monotonic() - after < 1.0
    assert grammars.process.pid == warm_pid  # the warm process served on
    # The refusal is remembered: the same schema costs no second compile.
    with pytest.raises(ValueError, match="did not compile within"):
        grammars.compile_now(SLOW)


def test_a_compile_past_its_memory_limit_is_refused(tiny_llama):
    small = Grammars(tiny_llama, 320, memory_bytes=32 << 20)
    try:
        with pytest.raises(ValueError, match="needs more than 32 MiB"):
            small.compile_now(StructuredOutputsParams(json={"type": "object", "properties": {
                f"p{i}": {"type": "string"} for i in range(400)}}))
        assert small.compile_now(StructuredOutputsParams(regex="a+")) is not None
    finally:
        small.shutdown()


def test_a_dead_compile_process_is_started_again(grammars):
    old_pid = grammars.process.pid
    lost = grammars.compile(StructuredOutputsParams(regex="lost-[a-z]+"))
    os.kill(old_pid, signal.SIGKILL)
    try:  # it may have compiled first; if not, its loss is not the constraint's failure
        lost.result(30).check()
    except ValueError as e:
        assert "compile process ended" in str(e)
    assert grammars.compile_now(StructuredOutputsParams(regex="lost-[a-z]+")) is not None
    assert grammars.process.pid not in (None, old_pid)


def test_shutdown_leaves_nothing(tiny_llama):
    owned = Grammars(tiny_llama, 320)
    slow = owned.compile(SLOW)
    (child,) = compile_children(_pid_once_started(owned))
    warm = psutil.Process(owned.process.pid)
    owned.shutdown()
    assert not psutil.pid_exists(child.pid) and not warm.is_running()
    with pytest.raises(ValueError, match="compile process ended"):
        slow.result(10)


def test_a_job_after_shutdown_fails_at_once(tiny_llama):
    """Never queued behind the sender's end, where nothing would answer it."""
    owned = Grammars(tiny_llama, 320)
    owned.shutdown()
    late = owned.process.submit("regex", "late", TIMEOUT_S, False)
    assert late.done()
    with pytest.raises(ValueError, match="shut down"):
        owned.compile_now(StructuredOutputsParams(regex="late"))
    assert owned.process.pid is None  # no process started for it


def _pid_once_started(grammars: Grammars, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while grammars.process.pid is None:
        assert time.monotonic() < deadline, "the compile process did not start"
        time.sleep(0.01)
    return grammars.process.pid


OWNER = """
import sys, time
from parashift import StructuredOutputsParams
from parashift.engine.structured_output import Grammars
grammars = Grammars(sys.argv[1], 320)
grammars.compile_now(StructuredOutputsParams(regex="warm"))
grammars.compile(StructuredOutputsParams(json={"type": "object", "properties": {
    f"p{i}": {"type": "string"} for i in range(3200)}}))
print(grammars.process.pid, flush=True)
time.sleep(600)
"""


def test_the_compile_process_dies_with_its_owner(tiny_llama):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, tiny_llama], stdout=subprocess.PIPE,
                             text=True)
    try:
        warm = psutil.Process(int(owner.stdout.readline()))
        (child,) = compile_children(warm.pid)
        assert "parashift-grammar" in " ".join(warm.cmdline())
    finally:
        owner.kill()
        owner.wait()
    assert not wait_gone([warm, child], 10)


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `procs` still running after `timeout` (a zombie has exited: whoever adopted
    it may never reap it)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)

"""The grammar compile process (`python -m parashift.engine.grammar_worker FD PARENT_PID NAME`,
started by engine/grammar_process.py): it loads xgrammar and the tokenizer once, stays warm,
and forks one child per compile. A child sets its own memory limit (RLIMIT_AS), compiles,
sends the result and exits; past its time limit this process kills it. So a compile can
really be stopped, a killed one leaves the warm process as it was (the next fork is ready in
milliseconds, not the seconds of a fresh interpreter loading xgrammar, torch and the
tokenizer), the children share the warm process's pages, and a slow compile never queues
the others (up to `max_compiles` run at once; a stopped one frees its slot at once).

Messages: wire/grammar_protocol.py. A child's result goes up its own pipe and is passed on as
it came (one writer on the owner's socket: this process)."""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from parashift.engine.grammar_compile import compile_constraint, first_line
from parashift.processes import die_with_parent, set_process_name, status_bytes
from parashift.wire.grammar_protocol import (
    Compiled,
    CompileFailed,
    CompileJob,
    CompilerReady,
    StartCompiler,
    decode_to_compiler,
    encode,
)

_OUT_OF_MEMORY = 3  # a child's exit code when even its result did not fit its memory limit


@dataclass
class _Running:
    job: CompileJob
    pid: int
    result: Connection  # the child's pipe (read end)
    deadline: float


class WarmCompiler:
    """The warm process's loop: jobs in, one forked child per job, results out."""

    def __init__(self, conn: Connection, compiler: Any, start: StartCompiler, name: str):
        self.conn = conn
        self.name = name
        self.compiler = compiler
        self.memory_bytes = start.memory_bytes
        self.max_compiles = start.max_compiles
        # (bounded by the owner: engine/structured_output.py `Grammars`)
        self.waiting: collections.deque[CompileJob] = collections.deque()
        self.running: dict[Connection, _Running] = {}

    def run(self) -> None:
        """Until the owner closes its end (or this process is told to stop)."""
        try:
            while True:
                now = time.monotonic()
                deadline = min((r.deadline for r in self.running.values()), default=None)
                timeout = None if deadline is None else max(0.0, deadline - now)
                for ready in wait([self.conn, *self.running], timeout):
                    if ready is self.conn:
                        try:
                            self.waiting.append(decode_to_compiler(self.conn.recv_bytes()))
                        except EOFError:
                            return
                    else:
                        self._finish(self.running.pop(ready))
                self._stop_late()
                while self.waiting and len(self.running) < self.max_compiles:
                    self._start(self.waiting.popleft())
        finally:
            for run in self.running.values():  # they die with this process anyway: reaped
                _kill(run.pid)

    def _start(self, job: CompileJob) -> None:
        result, child_end = _pipe()
        warm_pid = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            result.close()
            self._compile_in_child(job, child_end, warm_pid)
        child_end.close()
        self.running[result] = _Running(job, pid, result, time.monotonic() + job.timeout_s)

    def _compile_in_child(self, job: CompileJob, out: Connection, warm_pid: int) -> None:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (the warm process's handler)
            _die_with(warm_pid, signal.SIGKILL)
            set_process_name(f"{self.name}-compile")
            self.conn.close()  # only the warm process writes to the owner
            for run in self.running.values():
                run.result.close()
            # Address space the compile may add to what it inherited: past it, xgrammar's
            # allocations fail (MemoryError) instead of the machine's memory running out.
            limit = status_bytes("VmSize") + self.memory_bytes
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            out.send_bytes(encode(self._compile(job)))
        except MemoryError:
            os._exit(_OUT_OF_MEMORY)
        finally:
            os._exit(0)  # (after any other error too: the warm process reports it)

    def _compile(self, job: CompileJob) -> Compiled | CompileFailed:
        try:
            compiled = compile_constraint(self.compiler, job.kind, job.text)
            grammar = compiled.serialize_json() if job.send_grammar else ""
            return Compiled(job.job_id, compiled.memory_size_bytes, grammar)
        except MemoryError:
            return CompileFailed(job.job_id, self._too_big(job))
        except Exception as e:  # xgrammar's C++ errors (std::bad_alloc) are RuntimeErrors
            if "bad_alloc" in str(e):
                return CompileFailed(job.job_id, self._too_big(job))
            if isinstance(e, ValueError):  # compile_constraint's: names the field
                return CompileFailed(job.job_id, str(e))
            return CompileFailed(job.job_id, f"structured_outputs.{job.kind}: {first_line(e)}")

    def _finish(self, run: _Running) -> None:
        try:
            data = run.result.recv_bytes()
        except EOFError:  # died without a result: killed (the OOM killer) or crashed
            data = None
        run.result.close()
        _, status = os.waitpid(run.pid, 0)
        if data is None:
            code = os.waitstatus_to_exitcode(status)  # -N: signal N
            # SIGKILL: the kernel's OOM killer (ours come only past the deadline)
            why = (self._too_big(run.job) if code in (_OUT_OF_MEMORY, -signal.SIGKILL)
                   else f"structured_outputs.{run.job.kind}: the compile failed "
                        f"(its process ended with code {code})")
            data = encode(CompileFailed(run.job.job_id, why))
        self.conn.send_bytes(data)

    def _stop_late(self) -> None:
        now = time.monotonic()
        for conn, run in list(self.running.items()):
            if run.deadline <= now:
                del self.running[conn]
                _kill(run.pid)
                conn.close()
                self.conn.send_bytes(encode(CompileFailed(
                    run.job.job_id, f"the {run.job.kind} constraint did not compile within "
                                    f"{run.job.timeout_s:g} s")))

    def _too_big(self, job: CompileJob) -> str:
        return (f"structured_outputs.{job.kind}: the constraint needs more than "
                f"{self.memory_bytes >> 20} MiB to compile")


def _pipe() -> tuple[Connection, Connection]:
    import multiprocessing

    return multiprocessing.Pipe(duplex=False)


def _kill(pid: int) -> None:
    """SIGKILL and reap: the process is gone (no zombie) when this returns."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _die_with(parent_pid: int, sig: int) -> None:
    """`sig` when the parent dies (Linux); an exit now if it already has."""
    try:
        ctypes.CDLL(None).prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


_warm: WarmCompiler | None = None


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM (the owner's stop, or its death): the compiles killed and reaped, then out
    (raising here could land in any __del__, where it would be ignored)."""
    if _warm is not None:
        for run in list(_warm.running.values()):
            _kill(run.pid)
    os._exit(0)


def main(fd: int, parent_pid: int, name: str) -> None:
    set_process_name(name)
    die_with_parent()
    if os.getppid() != parent_pid:  # the owner died before the line above
        return
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides when this ends
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    conn = Connection(fd)
    start = decode_to_compiler(conn.recv_bytes())
    assert isinstance(start, StartCompiler), start
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(start.tokenizer_path)  # nosec B615 (local path)
    # The model's vocabulary: ids past the tokenizer's (embedding padding) are masked.
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=start.vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send_bytes(encode(CompilerReady(info.serialize_json())))
    global _warm
    _warm = WarmCompiler(conn, compiler, start, name)
    _warm.run()


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    except (SystemExit, KeyboardInterrupt, BrokenPipeError, ConnectionResetError):
        pass
    os._exit(0)

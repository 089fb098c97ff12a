"""The owner's end of a grammar compile process (engine/grammar_worker.py is the other end):
started on the first job, restarted on the next job after it died, stopped with its owner.

Two threads per owner, so that neither the engine loop nor an API server's event loop ever
blocks on the process: one sends jobs (and starts the process: a child started by a thread
gets its death signal when that thread ends, so it is a thread that lives as long as the
owner), one reads results and turns each into its job's Future (deserializing a compiled
grammar releases the GIL). One thread each way also means a large job and a large result
can never wait on each other."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from parashift.wire.grammar_protocol import (
    Compiled,
    CompileFailed,
    CompileJob,
    CompilerReady,
    StartCompiler,
    decode_from_compiler,
    encode,
)

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 5.0  # SIGTERM, then SIGKILL


class CompileProcessEnded(ValueError):
    """The compile process ended under a job (killed, crashed, stopped): not the constraint's
    fault, so not remembered as its failure."""


@dataclass
class CompileResult:
    memory_size_bytes: int = 0
    grammar: Any = None  # xgrammar's CompiledGrammar, when the job asked for it
    # Why the constraint does not compile. A result, not the future's exception: an exception
    # kept in a cache gains the frames of everyone it is raised to (and their requests).
    error: str | None = None

    def check(self) -> Any:
        """The grammar, or a new ValueError with the error."""
        if self.error is not None:
            raise ValueError(self.error)
        return self.grammar


@dataclass(eq=False)
class _Instance:
    """One run of the compile process."""

    proc: subprocess.Popen
    sock: socket.socket
    conn: Connection
    info_json: str = ""  # from CompilerReady: compiled grammars bind to it
    info: Any = None  # xgrammar's TokenizerInfo, loaded from it with the first grammar
    is_dead: bool = False
    pending: dict[int, concurrent.futures.Future] = field(default_factory=dict)


class GrammarProcess:
    def __init__(self, start: StartCompiler, name: str):
        self.start = start
        self.name = name  # the process's, as `ps` shows it
        # Bounded by the owner: an API server's Grammars refuses past a few waiting, an
        # engine's waiting requests (one compile each) are bounded by --max-waiting-requests.
        self._jobs: queue.SimpleQueue[tuple[CompileJob, concurrent.futures.Future] | None] = (
            queue.SimpleQueue())
        self._job_ids = itertools.count()
        # Its own lock: the owner calls submit holding its lock, which the futures' callbacks
        # take, and the sender resolves futures holding `_lock`.
        self._queue_lock = threading.Lock()
        self._is_closed = False  # no job queued after shutdown's sentinel
        self._lock = threading.Lock()  # the instance and its pending jobs
        self._instance: _Instance | None = None
        self._is_shut_down = False
        self._sender = threading.Thread(target=self._send_jobs, name=f"{name}-send",
                                        daemon=True)
        self._sender.start()

    @property
    def pid(self) -> int | None:
        """The running process's (None before the first job and after it died)."""
        instance = self._instance
        return None if instance is None or instance.is_dead else instance.proc.pid

    def submit(self, kind: str, text: str, timeout_s: float, send_grammar: bool
               ) -> concurrent.futures.Future:
        """A CompileResult (its `error` says why a constraint does not compile), or
        CompileProcessEnded when the process ended under it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        # Running from the start: a caller that stops waiting (asyncio's wrap_future cancels
        # on a client's disconnect) cannot cancel it for the others that share it.
        future.set_running_or_notify_cancel()
        job = CompileJob(next(self._job_ids), kind, text, timeout_s, send_grammar)
        with self._queue_lock:  # a job queued behind shutdown's sentinel is never answered
            if not self._is_closed:
                self._jobs.put((job, future))
                return future
        future.set_exception(CompileProcessEnded("the grammar compiler was shut down"))
        return future

    def shutdown(self) -> None:
        """The process and its compiles are gone when this returns; a later job fails at once."""
        with self._queue_lock:
            self._is_closed = True
            self._jobs.put(None)
        with self._lock:
            self._is_shut_down = True  # no job queued before it starts another
            instance, self._instance = self._instance, None
        if instance is not None:
            _stop(instance.proc)
            with contextlib.suppress(OSError):  # (the reader may have closed it already)
                instance.sock.shutdown(socket.SHUT_RDWR)

    def _send_jobs(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            with self._lock:
                instance = self._instance
                if self._is_shut_down:
                    _set(future, error=CompileProcessEnded("the grammar compiler was shut down"))
                    continue
                if instance is None or instance.is_dead:
                    try:
                        instance = self._instance = self._start()
                    except OSError as e:
                        _set(future, error=CompileProcessEnded(
                            f"the grammar compile process did not start: {e}"))
                        continue
                instance.pending[job.job_id] = future
            try:
                instance.conn.send_bytes(encode(job))
            except OSError:
                pass  # it died: its reader fails the job

    def _start(self) -> _Instance:
        mine, theirs = socket.socketpair()
        with theirs:
            # our own interpreter and module, no shell
            proc = subprocess.Popen(  # nosec B603
                [sys.executable, "-m", "parashift.engine.grammar_worker", str(theirs.fileno()),
                 str(os.getpid()), self.name], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
        instance = _Instance(proc, mine, Connection(os.dup(mine.fileno())))
        instance.conn.send_bytes(encode(self.start))
        threading.Thread(target=self._read_results, args=(instance,), name=f"{self.name}-recv",
                         daemon=True).start()
        return instance

    def _read_results(self, instance: _Instance) -> None:
        while True:
            try:
                data = instance.conn.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                msg = decode_from_compiler(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropped a malformed frame from %s: %s", self.name, e)
                continue
            if isinstance(msg, CompilerReady):
                instance.info_json = msg.tokenizer_info
                continue
            with self._lock:
                future = instance.pending.pop(msg.job_id, None)
            if future is not None:
                _resolve(future, msg, instance)
        with self._lock:
            instance.is_dead = True
            lost, instance.pending = instance.pending, {}
        instance.conn.close()
        instance.sock.close()
        _stop(instance.proc)  # it closed its end: ending, or to be ended (and reaped)
        code = instance.proc.returncode
        if lost and not self._is_shut_down:
            logger.error("%s ended (exit code %s) under %d compiles", self.name, code,
                         len(lost))
        for future in lost.values():
            _set(future, error=CompileProcessEnded(
                f"the grammar compile process ended (exit code {code})"))


def _resolve(future: concurrent.futures.Future, msg: Compiled | CompileFailed,
             instance: _Instance) -> None:
    if isinstance(msg, CompileFailed):
        _set(future, CompileResult(error=msg.error))
        return
    grammar = None
    if msg.grammar:  # (an API server's checks never load xgrammar here)
        import xgrammar as xgr

        try:
            if instance.info is None:
                instance.info = xgr.TokenizerInfo.deserialize_json(instance.info_json)
            grammar = xgr.CompiledGrammar.deserialize_json(msg.grammar, instance.info)
        except (RuntimeError, ValueError) as e:  # xgrammar's Deserialize*Error among them
            _set(future, CompileResult(error=f"a compiled grammar did not load: {e}"))
            return
    _set(future, CompileResult(msg.memory_size_bytes, grammar))


def _set(future: concurrent.futures.Future, result: Any = None,
         error: BaseException | None = None) -> None:
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled by its caller


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()  # it kills and reaps its compiles first
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()  # its compiles die with it (their parent-death signal)
        proc.wait()

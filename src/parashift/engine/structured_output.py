"""Structured outputs on the engine core's side, with xgrammar (vLLM's default backend).

Each distinct constraint is compiled once against the tokenizer's vocabulary, in a process of
its own that a time limit can stop (engine/grammar_process.py, engine/grammar_worker.py), and
kept in a byte-bounded LRU cache (compiled grammars, and failures: the same constraint fails
the same way without compiling again). A request whose grammar is still compiling waits in
the queue while the others run. Each request then has a matcher: the scheduler fills one
bitmask row per constrained request that samples in a step, ships the rows with the step
(types/outputs.py `GrammarBitmask`), and the model runner masks those rows' logits before
sampling (layers/token_mask.py); unconstrained rows cost nothing. The matcher accepts each
sampled token as it comes back.

Preemption and recompute need no rollback or replay: a preempted request keeps its output
tokens (it is recomputed from them, never resampled), so its matcher's state stays exact; a
token of a batch that was discarded in flight is never accepted. Prefix-cache hits change
only what is computed, not the tokens. A state where the grammar allows no token lets the
end-of-sequence token through, which the matcher then refuses: the request ends with
`stop`, never hangs or samples from an empty distribution. How a constraint becomes a
grammar (compact JSON, no control characters): engine/grammar_compile.py."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import math
import sys
import threading
import time
from typing import Any

from parashift.engine.grammar_process import CompileProcessEnded, CompileResult, GrammarProcess
from parashift.types.outputs import GrammarBitmask
from parashift.types.structured_outputs import StructuredOutputsParams
from parashift.wire.grammar_protocol import StartCompiler

CACHE_BYTES = 256 << 20  # compiled grammars, keys and failures kept, least recently used out
# An API server keeps only outcomes, and any client can add them (one distinct failing regex
# each): a smaller budget, about 8,000 entries.
CHECK_CACHE_BYTES = 16 << 20
COMPILE_TIMEOUT_S = 30.0  # past it a compile is killed and its constraint refused
COMPILE_MEMORY_BYTES = 2 << 30  # address space one compile may add (RLIMIT_AS)
MAX_COMPILES = 4  # at once, each in its own process; more wait for a slot
# An API server's compiles waiting for a slot; past them a new constraint is refused at once
# (CompilesBusy, a 429): N slow distinct constraints can then make a request wait at most
# (1 + MAX_PENDING_CHECKS / MAX_COMPILES) time limits, not N / MAX_COMPILES of them.
MAX_PENDING_CHECKS = 2 * MAX_COMPILES
START_TIMEOUT_S = 120.0  # the compile process's own start (imports, the tokenizer)
# A cache entry's own objects beside its grammar and error text: the digest, its Future (with
# its Condition and lock: 1,600 bytes alone), the CompileResult, the done callback, the dicts'
# slots. Measured with tracemalloc through compile() on CPython 3.11: about 1,910 bytes
# (tests/engine/test_grammars.py checks the count against the measure).
ENTRY_BYTES = 2000
RETRY_AFTER_MIN_S = 1.0


class CompilesBusy(Exception):
    """Too many compiles pending to take another: retry after `retry_after` seconds (not the
    constraint's fault, so not a ValueError and never cached)."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class Grammars:
    """The compiler of one model's vocabulary and its cache. The compile process starts on
    the first constraint: an engine with no constrained request never loads it.
    `keep_grammars=False` (an API server, which only checks that a constraint compiles): no
    compiled grammar crosses back, the cache keeps only the outcome (in CHECK_CACHE_BYTES),
    and past MAX_PENDING_CHECKS compiles waiting a new one is refused (CompilesBusy). An
    engine never refuses: each of its waiting requests holds at most one compile and
    --max-waiting-requests bounds those, so its queue is bounded already."""

    def __init__(self, tokenizer_path: str, vocab_size: int, *, name: str = "parashift-grammar",
                 keep_grammars: bool = True, timeout_s: float = COMPILE_TIMEOUT_S,
                 memory_bytes: int = COMPILE_MEMORY_BYTES):
        self.vocab_size = vocab_size
        self.keep_grammars = keep_grammars
        self.timeout_s = timeout_s
        self.cache_bytes = CACHE_BYTES if keep_grammars else CHECK_CACHE_BYTES
        self.max_pending: int | None = None if keep_grammars else MAX_PENDING_CHECKS
        self.process = GrammarProcess(
            StartCompiler(tokenizer_path, vocab_size, memory_bytes, MAX_COMPILES), name)
        # By a digest of the constraint: a key costs 32 bytes, whatever the schema's size.
        self._cache: collections.OrderedDict[bytes, concurrent.futures.Future] = (
            collections.OrderedDict())
        self._sizes: dict[bytes, int] = {}  # each entry's bytes, as far as known
        self.num_bytes = 0  # their sum: at most cache_bytes once evicted
        # Compiles sent and not yet ended (evicted from the cache or not), by when they were
        # sent, oldest first: running (at most MAX_COMPILES) or waiting for a slot.
        self._in_flight: dict[concurrent.futures.Future, float] = {}
        self._lock = threading.Lock()  # callers and the reader thread (completions)
        self.hits = self.misses = 0

    @property
    def max_wait_s(self) -> float:
        """The longest a compile sent now can take to answer: the process's start, the
        compiles waiting ahead of it (MAX_COMPILES at a time), then its own time limit."""
        rounds = 1  # its own
        if self.max_pending is not None:
            rounds += math.ceil(self.max_pending / MAX_COMPILES)
        return START_TIMEOUT_S + rounds * self.timeout_s

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """A CompileResult, now or later (a failure is its `error`, kept like a grammar: the
        same constraint fails the same way without compiling again), or CompileProcessEnded.
        CompilesBusy for a constraint not cached while too many compiles wait."""
        kind, text = params.key
        try:
            key = hashlib.sha256(kind.encode() + b"\n" + text.encode()).digest()
        except UnicodeEncodeError:  # a lone surrogate: no grammar or wire carries it
            raise ValueError(f"structured_outputs.{kind} is not valid Unicode") from None
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return future
            self._check_room()
            self.misses += 1
            future = self.process.submit(kind, text, self.timeout_s, self.keep_grammars)
            self._cache[key] = future
            self._sizes[key] = ENTRY_BYTES
            self.num_bytes += ENTRY_BYTES
            self._in_flight[future] = time.monotonic()
        future.add_done_callback(lambda f: self._on_compiled(key, f))
        return future

    def _check_room(self) -> None:
        if self.max_pending is None or len(self._in_flight) < MAX_COMPILES + self.max_pending:
            return
        # The oldest compile has most likely run since it was sent: it ends (and a slot frees)
        # by its time limit.
        oldest = next(iter(self._in_flight.values()))
        left = oldest + self.timeout_s - time.monotonic()
        raise CompilesBusy(f"{len(self._in_flight)} constraints are compiling on this server, "
                           "as many as it takes: retry later",
                           min(self.timeout_s, max(RETRY_AFTER_MIN_S, left)))

    def _on_compiled(self, key: bytes, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._in_flight.pop(future, None)
            if self._cache.get(key) is not future:
                return  # evicted (or cleared) while it compiled
            if isinstance(future.exception(), CompileProcessEnded):  # not the constraint's
                self._remove(key)
                return
            result: CompileResult = future.result()
            size = ENTRY_BYTES
            if result.error is not None:
                size += sys.getsizeof(result.error)
            if result.grammar is not None:
                size += result.memory_size_bytes
            self.num_bytes += size - self._sizes[key]
            self._sizes[key] = size
            self._evict()

    def _evict(self) -> None:
        """Least recently used first, past cache_bytes (the most recent stays)."""
        while self.num_bytes > self.cache_bytes and len(self._cache) > 1:
            self._remove(next(iter(self._cache)))

    def _remove(self, key: bytes) -> None:
        del self._cache[key]
        self.num_bytes -= self._sizes.pop(key)

    def compile_now(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (None with keep_grammars=False), or ValueError naming the
        problem (a compile past the time limit included)."""
        future = self.compile(params)
        try:
            result = future.result(self.max_wait_s)
        except concurrent.futures.TimeoutError:  # the process never answered (not started)
            raise ValueError(f"the {params.kind} constraint did not compile: the grammar "
                             "compile process does not answer") from None
        return result.check()

    def clear(self) -> None:
        """Forget every compiled grammar and the counts (the compile process stays)."""
        with self._lock:
            self._cache.clear()
            self._sizes.clear()
            self.num_bytes = self.hits = self.misses = 0

    def wait_for_any(self, timeout: float) -> None:
        """Until a compile in progress ends, or `timeout` seconds."""
        with self._lock:
            pending = [f for f in self._cache.values() if not f.done()]
        if pending:
            concurrent.futures.wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)

    @property
    def hit_rate(self) -> float:
        asked = self.hits + self.misses
        return self.hits / asked if asked else 0.0

    def shutdown(self) -> None:
        """The compile process and its compiles are gone when this returns."""
        self.process.shutdown()


class GrammarState:
    """One request's constraint: its compile, then its matcher."""

    def __init__(self, future: concurrent.futures.Future, eos_token_id: int | None):
        self._future = future  # Grammars.compile's
        self._eos = eos_token_id
        self.matcher: Any = None
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        """Compiled (or failed: `error` says why); polled by the scheduler, never blocking."""
        if self.matcher is None and self.error is None and self._future.done():
            try:
                import xgrammar as xgr

                stops = None if self._eos is None else [self._eos]
                result: CompileResult = self._future.result()
                self.matcher = xgr.GrammarMatcher(result.check(), override_stop_tokens=stops)
            except ValueError as e:
                self.error = str(e)
        return self.matcher is not None or self.error is not None

    def accept(self, token_id: int) -> bool:
        """False when the grammar refuses the token or has ended: the request stops."""
        return self.matcher.accept_token(token_id) and not self.matcher.is_terminated()


def fill_bitmask(states: list[tuple[str, GrammarState]], vocab_size: int
                 ) -> GrammarBitmask | None:
    """One row per constrained request that samples this step: the tokens its grammar allows
    next (bit t of word t // 32), or only end-of-sequence where it allows none."""
    if not states:
        return None
    import xgrammar as xgr

    from parashift.layers.profiling import profiler_label

    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)
    with profiler_label("parashift::grammar"):
        for row, (_, state) in enumerate(states):
            state.matcher.fill_next_token_bitmask(bitmask, row)
            if not bitmask[row].any() and state._eos is not None:
                bit = 1 << (state._eos % 32)
                bitmask[row, state._eos // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit
    return GrammarBitmask([req_id for req_id, _ in states], bitmask.shape[1],
                          bitmask.numpy().tobytes())

"""Structured outputs on the engine core's side, with xgrammar (vLLM's default backend).

Each distinct constraint is compiled once against the tokenizer's vocabulary, in one thread
off the engine loop, and kept in an LRU cache of compiled grammars. A request whose grammar is
still compiling waits in the queue while the others run. Each request then has a matcher: the
scheduler fills one bitmask row per constrained request that samples in a step, ships the rows
with the step (types/outputs.py `GrammarBitmask`), and the model runner masks those rows'
logits before sampling (layers/token_mask.py); unconstrained rows cost nothing. The matcher
accepts each sampled token as it comes back.

Preemption and recompute need no rollback or replay: a preempted request keeps its output
tokens (it is recomputed from them, never resampled), so its matcher's state stays exact; a
token of a batch that was discarded in flight is never accepted. Prefix-cache hits change
only what is computed, not the tokens. A state where the grammar allows no token lets the
end-of-sequence token through, which the matcher then refuses: the request ends with
`stop`, never hangs or samples from an empty distribution.

JSON is generated compact (no free whitespace between tokens, as vLLM's
`disable_any_whitespace`); `json_object` is the schema {"type": "object"}: a model can never
loop on whitespace. xgrammar's strings (and a regex's negated classes) take raw control
characters and the UTF-16 surrogates U+D800-U+DFFF, which JSON forbids and UTF-8 cannot
carry (the text would not decode): they are taken out of every negated class of JSON and
regex grammars before they compile."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re
import threading
from typing import Any

from parashift.types.outputs import GrammarBitmask
from parashift.types.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_BYTES = 256 << 20  # compiled grammars kept, least recently used out first
COMPILE_TIMEOUT_S = 30.0  # past it a request's constraint is refused


class Grammars:
    """The compiler of one model's vocabulary and its cache. The tokenizer is loaded in the
    compile thread on first use: an engine with no constrained request never loads it."""

    def __init__(self, tokenizer: Any | str, vocab_size: int):
        self._tokenizer = tokenizer  # an object, or the path to load it from
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "grammar-compile")
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = (
            collections.OrderedDict())
        self._lock = threading.Lock()  # callers and the compile thread (its evictions)
        self.hits = self.misses = 0

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar, now or later (a failure is the future's ValueError, kept
        like a result: the same constraint fails the same way)."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():
                self._cache.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
        future.add_done_callback(self._on_compiled)
        return future

    def _on_compiled(self, _: concurrent.futures.Future) -> None:
        with self._lock:
            self._evict()

    def _evict(self) -> None:
        """Least recently used first, past CACHE_BYTES of compiled grammars (the most recent
        stays)."""
        total, sizes = 0, {}
        for key, future in self._cache.items():
            done = future.done() and not future.cancelled() and future.exception() is None
            sizes[key] = future.result().memory_size_bytes if done else 0
            total += sizes[key]
        for key in list(self._cache):
            if total <= CACHE_BYTES or len(self._cache) == 1:
                break
            total -= sizes[key]
            del self._cache[key]

    def compile_now(self, params: StructuredOutputsParams,
                    timeout: float = COMPILE_TIMEOUT_S) -> Any:
        """Compiled, or ValueError naming the problem (a compile past `timeout` included)."""
        future = self.compile(params)
        try:
            compiled = future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"the {params.kind} constraint did not compile within "
                             f"{timeout:.0f} s") from None
        self._on_compiled(future)  # its callback may not have run yet
        return compiled

    def clear(self) -> None:
        """Forget every compiled grammar and the counts (the vocabulary stays)."""
        with self._lock:
            self._cache.clear()
            self.hits = self.misses = 0

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
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import xgrammar as xgr

        compiler = self._compiler_here()
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = params.json if kind == "json" else '{"type": "object"}'
                grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                                       strict_mode=True)
                return compiler.compile_grammar(text_only(str(grammar)))
            if kind == "regex":
                return compiler.compile_grammar(text_only(str(xgr.Grammar.from_regex(
                    params.regex))))
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice or []))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError) as e:
            raise ValueError(f"structured_outputs.{kind}: {_first_line(e)}") from None

    def _compiler_here(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tokenizer = self._tokenizer
            if isinstance(tokenizer, str):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tokenizer)  # nosec B615 (local path)
            # The model's vocabulary: ids past the tokenizer's (embedding padding) are masked.
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def text_only(ebnf: str) -> str:
    """`ebnf` with control characters and UTF-16 surrogates out of every negated character
    class (a `[^` inside a quoted literal or a class is left as it is)."""
    out, i, quoted, in_class = [], 0, False, False
    while i < len(ebnf):
        ch = ebnf[i]
        if ch == "\\":  # an escape: the next character is literal
            out.append(ebnf[i:i + 2])
            i += 2
            continue
        if quoted:
            quoted = ch != '"'
        elif in_class:
            in_class = ch != "]"
        elif ch == '"':
            quoted = True
        elif ch == "[":
            in_class = True
            if ebnf.startswith("[^", i):
                out.append("[^\\0-\\x1f\\uD800-\\uDFFF")
                i += 2
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of `choices` (JSON string literals are EBNF's escapes too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _first_line(error: BaseException) -> str:
    """xgrammar's message, without its log prefix ("[12:00:00] /path/file.cc:94: ")."""
    text = (str(error).strip() or type(error).__name__).splitlines()[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:500]


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
                self.matcher = xgr.GrammarMatcher(self._future.result(),
                                                  override_stop_tokens=stops)
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

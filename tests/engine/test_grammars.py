"""The grammar side of structured outputs on its own (engine/structured_output.py,
engine/grammar_compile.py, layers/token_mask.py): one compile per constraint, the cache's byte
bound counting keys, failures and each entry's measured cost (an API server's smaller budget
holding after many failures), an API server's compiles refused past the pending bound,
choices as literals, no control characters or surrogates in JSON strings, and the bitmask
applied to its rows only. The compile process itself (limits, restarts, its end):
test_grammar_process.py."""

from __future__ import annotations

import concurrent.futures
import sys
import tracemalloc

import pytest
import torch

from parashift import StructuredOutputsParams
from parashift.engine.grammar_compile import choice_grammar, text_only
from parashift.engine.grammar_process import CompileResult
from parashift.engine.structured_output import (
    CHECK_CACHE_BYTES,
    ENTRY_BYTES,
    MAX_COMPILES,
    MAX_PENDING_CHECKS,
    START_TIMEOUT_S,
    CompilesBusy,
    Grammars,
)
from parashift.layers.token_mask import apply_token_bitmask


@pytest.fixture(scope="module")
def grammars(tiny_llama):
    made = Grammars(tiny_llama, 320)
    yield made
    made.shutdown()


def test_each_constraint_compiles_once(grammars):
    grammars.clear()
    for _ in range(3):
        grammars.compile_now(StructuredOutputsParams(json={"type": "integer"}))
    grammars.compile_now(StructuredOutputsParams(choice=["a", "b"]))
    assert (grammars.misses, grammars.hits) == (2, 2)


def test_the_cache_counts_grammars_keys_and_failures(grammars, monkeypatch):
    grammars.clear()
    first = grammars.compile_now(StructuredOutputsParams(regex="a{1,4}"))
    assert grammars.num_bytes == ENTRY_BYTES + first.memory_size_bytes
    # A failure is kept (it fails again without compiling again) and counted, message and all;
    # a long constraint costs no more than a short one (its key is a digest).
    for _ in range(2):
        with pytest.raises(ValueError, match="regex") as failed:
            grammars.compile_now(StructuredOutputsParams(regex="(" + "x" * 100_000))
    assert grammars.misses == 2 and grammars.hits == 1
    assert grammars.num_bytes == (2 * ENTRY_BYTES + first.memory_size_bytes
                                  + sys.getsizeof(str(failed.value)))
    monkeypatch.setattr(grammars, "cache_bytes", grammars.num_bytes)
    with pytest.raises(ValueError, match="regex"):
        grammars.compile_now(StructuredOutputsParams(regex="[z"))
    assert len(grammars._cache) == 2  # the least recently used went
    assert grammars.num_bytes <= grammars.cache_bytes


def test_an_api_servers_cache_keeps_no_grammar(tiny_llama):
    checks = Grammars(tiny_llama, 320, keep_grammars=False)
    try:
        assert checks.compile_now(StructuredOutputsParams(regex="a{1,4}")) is None
        assert checks.num_bytes == ENTRY_BYTES
        assert checks.cache_bytes == CHECK_CACHE_BYTES
    finally:
        checks.shutdown()


class FakeProcess:
    """GrammarProcess's submit without a process: each job fails at once (as a regex that
    does not compile would), or waits in `held` for the test to end it."""

    def __init__(self, hold: bool = False):
        self.hold = hold
        self.held: list[concurrent.futures.Future] = []

    def submit(self, kind: str, text: str, timeout_s: float, send_grammar: bool
               ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        if self.hold:
            self.held.append(future)
        else:  # distinct messages, as xgrammar's quote their constraint
            future.set_result(CompileResult(error=f"structured_outputs.{kind}: bad {text}"))
        return future

    def shutdown(self) -> None:
        pass


def fake_grammars(keep_grammars: bool, hold: bool = False) -> Grammars:
    made = Grammars("unused", 320, keep_grammars=keep_grammars, timeout_s=5.0)
    made.process.shutdown()  # (never started: the compile process starts on a first job)
    made.process = FakeProcess(hold)  # type: ignore[assignment]
    return made


def _fail_all(grammars: Grammars, first: int, count: int) -> None:
    for i in range(first, first + count):
        grammars.compile(StructuredOutputsParams(regex=f"({i}"))


def test_an_entrys_count_is_its_measured_memory():
    grammars = fake_grammars(keep_grammars=False)
    _fail_all(grammars, 0, 100)  # the dicts and allocator warm
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        counted = grammars.num_bytes
        _fail_all(grammars, 100, 2000)
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    counted = grammars.num_bytes - counted
    assert len(grammars._cache) == 2100  # none evicted: all of them measured
    assert measured / 2 <= counted <= measured * 2, (counted, measured)


def test_an_api_servers_cache_stays_in_its_budget_after_many_failures():
    grammars = fake_grammars(keep_grammars=False)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _fail_all(grammars, 0, 2 * CHECK_CACHE_BYTES // ENTRY_BYTES)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grammars.num_bytes <= CHECK_CACHE_BYTES
    assert len(grammars._cache) < CHECK_CACHE_BYTES // ENTRY_BYTES  # some were evicted
    assert grown < 1.5 * CHECK_CACHE_BYTES, grown


def test_an_api_server_refuses_compiles_past_the_pending_bound():
    grammars = fake_grammars(keep_grammars=False, hold=True)
    first = [grammars.compile(StructuredOutputsParams(regex=f"r{i}"))
             for i in range(MAX_COMPILES + MAX_PENDING_CHECKS)]
    with pytest.raises(CompilesBusy) as busy:
        grammars.compile(StructuredOutputsParams(regex="one too many"))
    assert 1.0 <= busy.value.retry_after <= grammars.timeout_s
    # A constraint already compiling or cached adds no compile: it is never refused.
    assert grammars.compile(StructuredOutputsParams(regex="r0")) is first[0]
    grammars.process.held[0].set_result(CompileResult(error="done"))
    assert grammars.compile(StructuredOutputsParams(regex="one too many")) is not None
    # Evicted while compiling, a compile still counts: it still holds its slot.
    grammars.clear()
    with pytest.raises(CompilesBusy):
        grammars.compile(StructuredOutputsParams(regex="another"))
    # No request waits past the process's start, the compiles ahead of it, then its own.
    assert grammars.max_wait_s == START_TIMEOUT_S + 3 * grammars.timeout_s


def test_an_engine_never_refuses_a_compile():
    """Its queue is bounded by --max-waiting-requests: one compile at most per request."""
    grammars = fake_grammars(keep_grammars=True, hold=True)
    for i in range(10 * (MAX_COMPILES + MAX_PENDING_CHECKS)):
        grammars.compile(StructuredOutputsParams(regex=f"r{i}"))
    assert grammars.max_wait_s == START_TIMEOUT_S + grammars.timeout_s


def test_choices_are_escaped_as_string_literals():
    assert choice_grammar(['a"b', "c\\d", "e\nf"]) == r'root ::= "a\"b" | "c\\d" | "e\nf"'


def test_negated_classes_lose_control_characters_and_surrogates_only():
    """xgrammar's strings would take them; JSON forbids the one, UTF-8 cannot carry the
    other. A `[^` inside a literal or another class stays."""
    assert text_only(r'a ::= [^"\\] "[^x" [a^] "q\"[^" [\]^]') == (
        r'a ::= [^\0-\x1f\uD800-\uDFFF"\\] "[^x" [a^] "q\"[^" [\]^]')


def test_json_strings_never_hold_control_characters_or_surrogates(tiny_llama, grammars):
    import xgrammar as xgr

    compiled = grammars.compile_now(StructuredOutputsParams(
        json={"type": "string", "maxLength": 3}))
    from transformers import AutoTokenizer

    vocab = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(tiny_llama),
                                               vocab_size=320).decoded_vocab
    # (the tiny tokenizer has one token a byte)
    for text, accepted in ((b'"\xed\xa0\x80', False), (b'"\x01', False),
                           (b'"\xed\x9f\xbf"', True)):
        matcher = xgr.GrammarMatcher(compiled)
        assert all(matcher.accept_token(vocab.index(bytes([b]))) for b in text) == accepted


def test_the_bitmask_masks_only_its_rows():
    logits = torch.zeros(3, 40)
    words = torch.zeros(2, 2, dtype=torch.int32)
    words[0, 0] = 1 << 3  # row for logits row 2: token 3 only
    words[1, 1] = 1 << 1  # row for logits row 0: token 33 only
    apply_token_bitmask(logits, [2, 0], words.numpy().tobytes(), 2)
    assert torch.isfinite(logits[1]).all()  # unconstrained
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [3]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [33]

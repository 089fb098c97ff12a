"""The grammar side of structured outputs on its own (engine/structured_output.py,
layers/token_mask.py): one compile per constraint, the cache's byte bound and cached failures,
a compile past its limit refused, choices as literals, no control characters or surrogates
in JSON strings, and the bitmask applied to its rows only."""

from __future__ import annotations

import pytest
import torch

from parashift import StructuredOutputsParams
from parashift.engine.structured_output import Grammars, choice_grammar, text_only
from parashift.layers.token_mask import apply_token_bitmask


def test_a_compile_past_its_time_limit_is_refused(tiny_llama):
    import threading

    release = threading.Event()
    grammars = Grammars(tiny_llama, 320)
    compile_ = grammars._compile
    grammars._compile = lambda params: (release.wait(60), compile_(params))[1]
    try:
        with pytest.raises(ValueError, match="did not compile within 0 s"):
            grammars.compile_now(StructuredOutputsParams(regex="a+"), timeout=0.2)
    finally:
        release.set()
        grammars.shutdown()


def test_each_constraint_compiles_once(tiny_llama):
    grammars = Grammars(tiny_llama, 320)
    try:
        for _ in range(3):
            grammars.compile_now(StructuredOutputsParams(json={"type": "integer"}))
        grammars.compile_now(StructuredOutputsParams(choice=["a", "b"]))
        assert (grammars.misses, grammars.hits) == (2, 2)
    finally:
        grammars.shutdown()


def test_the_cache_keeps_its_bytes_and_failures(tiny_llama, monkeypatch):
    from parashift.engine import structured_output

    grammars = Grammars(tiny_llama, 320)
    try:
        first = grammars.compile_now(StructuredOutputsParams(regex="a{1,4}"))
        monkeypatch.setattr(structured_output, "CACHE_BYTES", first.memory_size_bytes)
        grammars.compile_now(StructuredOutputsParams(regex="b{1,4}"))
        assert len(grammars._cache) == 1  # the least recently used went
        for _ in range(2):  # a bad constraint fails again without compiling again
            with pytest.raises(ValueError, match="regex"):
                grammars.compile_now(StructuredOutputsParams(regex="("))
        assert grammars.misses == 3 and grammars.hits == 1
    finally:
        grammars.shutdown()


def test_choices_are_escaped_as_string_literals():
    assert choice_grammar(['a"b', "c\\d", "e\nf"]) == r'root ::= "a\"b" | "c\\d" | "e\nf"'


def test_negated_classes_lose_control_characters_and_surrogates_only():
    """xgrammar's strings would take them; JSON forbids the one, UTF-8 cannot carry the
    other. A `[^` inside a literal or another class stays."""
    assert text_only(r'a ::= [^"\\] "[^x" [a^] "q\"[^" [\]^]') == (
        r'a ::= [^\0-\x1f\uD800-\uDFFF"\\] "[^x" [a^] "q\"[^" [\]^]')


def test_json_strings_never_hold_control_characters_or_surrogates(tiny_llama):
    import xgrammar as xgr

    grammars = Grammars(tiny_llama, 320)
    try:
        compiled = grammars.compile_now(StructuredOutputsParams(
            json={"type": "string", "maxLength": 3}))
    finally:
        grammars.shutdown()
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

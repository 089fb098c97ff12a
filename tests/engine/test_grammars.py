"""The grammar side of structured outputs on its own (engine/structured_output.py,
engine/grammar_compile.py, layers/token_mask.py): one compile per constraint, the cache's byte
bound counting keys and failures, choices as literals, no control characters or surrogates
in JSON strings, and the bitmask applied to its rows only. The compile process itself
(limits, restarts, its end): test_grammar_process.py."""

from __future__ import annotations

import pytest
import torch

from parashift import StructuredOutputsParams
from parashift.engine.grammar_compile import choice_grammar, text_only
from parashift.engine.structured_output import ENTRY_BYTES, Grammars
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
    from parashift.engine import structured_output

    grammars.clear()
    first = grammars.compile_now(StructuredOutputsParams(regex="a{1,4}"))
    assert grammars.num_bytes == ENTRY_BYTES + 32 + first.memory_size_bytes
    # A failure is kept (it fails again without compiling again) and counted, message and all;
    # a long constraint costs no more than a short one (its key is a digest).
    for _ in range(2):
        with pytest.raises(ValueError, match="regex") as failed:
            grammars.compile_now(StructuredOutputsParams(regex="(" + "x" * 100_000))
    assert grammars.misses == 2 and grammars.hits == 1
    assert grammars.num_bytes == (2 * (ENTRY_BYTES + 32) + first.memory_size_bytes
                                  + len(str(failed.value)))
    monkeypatch.setattr(structured_output, "CACHE_BYTES", grammars.num_bytes)
    with pytest.raises(ValueError, match="regex"):
        grammars.compile_now(StructuredOutputsParams(regex="[z"))
    assert len(grammars._cache) == 2  # the least recently used went
    assert grammars.num_bytes <= structured_output.CACHE_BYTES


def test_an_api_servers_cache_keeps_no_grammar(tiny_llama):
    checks = Grammars(tiny_llama, 320, keep_grammars=False)
    try:
        assert checks.compile_now(StructuredOutputsParams(regex="a{1,4}")) is None
        assert checks.num_bytes == ENTRY_BYTES + 32
    finally:
        checks.shutdown()


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

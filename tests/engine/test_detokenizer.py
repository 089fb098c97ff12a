"""IncrementalDetokenizer.apply on a byte-level tokenizer (one token per byte): characters split
over tokens, stop strings over token borders, and what streaming may hand out when; TokenTexts,
the batch decode of logprob entries."""

from __future__ import annotations

from conftest import make_tokenizer  # tests/conftest.py

from parashift.engine.detokenizer import IncrementalDetokenizer, TokenTexts, decoder
from parashift.types.outputs import EngineCoreOutput

TOKENIZER = make_tokenizer()


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def detok(stop: list[str], include_stop: bool = False) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(TOKENIZER, ids("prompt"), True, stop, include_stop)


def out(text: str, finish_reason: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput("r", ids(text), finish_reason=finish_reason)


def test_a_character_split_over_tokens_waits_for_its_last_byte():
    d = detok([])
    e_acute = ids("é")
    assert len(e_acute) == 2
    first = d.apply(EngineCoreOutput("r", [*ids("h"), e_acute[0]]))
    assert first.text == "h" and first.finish_reason is None
    assert d.apply(EngineCoreOutput("r", [e_acute[1]])).text == "é"


def test_stop_string_over_token_borders_ends_the_sample_and_asks_for_an_abort():
    d = detok(["END"])
    held = d.apply(out("abc E"))  # the last 2 characters could start "END": held back
    assert held.text == "abc" and not held.abort
    assert d.apply(out("N")).text == " "
    hit = d.apply(out("Dxyz"))
    assert (hit.finish_reason, hit.stop_reason, hit.abort) == ("stop", "END", True)
    assert hit.text == "" and d.text == "abc "  # nothing of the stop string, nothing after
    assert d.apply(out("more")).text == ""  # late tokens of an aborted sample are ignored


def test_stop_string_wins_over_length_without_an_abort():
    d = detok(["!"], include_stop=True)
    end = d.apply(out("hi!", finish_reason="length"))
    assert (end.text, end.finish_reason, end.stop_reason, end.abort) == ("hi!", "stop", "!",
                                                                         False)


def test_finish_flushes_what_was_held_back():
    d = detok(["STOP"])
    assert d.apply(out("say ST")).text == "say"
    end = d.apply(out("", finish_reason="length"))
    assert (end.text, end.finish_reason, end.abort) == (" ST", "length", False)


def test_the_direct_decode_gives_what_the_tokenizer_decode_gives(smollm2_path):
    """SmolLM2's tokenizer is asked through `tokenizers` directly (no clean-up of spaces): the
    same text token by token as through transformers' decode, special tokens and multi-byte
    characters included; a tokenizer that cleans up spaces keeps its own decode."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert tok.clean_up_tokenization_spaces is False
    text = ("Hello, world! Ça coûte 5 € — 日本語のテキスト 🙂.\n  def f(x):\n\treturn x "
            "<|im_end|> après")
    token_ids = tok.encode(text)
    for skip in (True, False):
        fast = IncrementalDetokenizer(tok, token_ids[:3], skip, [], False)
        fast.update(token_ids[3:])
        assert fast.take(finished=True) == tok.decode(token_ids[3:], skip_special_tokens=skip)
        assert decoder(tok, skip).func == tok._tokenizer.decode
    tok.clean_up_tokenization_spaces = True
    assert decoder(tok, True).func == tok.decode


def test_stop_matching_is_linear_in_the_new_text():
    """64 stop strings of 1,024 characters: each new token's search covers only where the new
    text can complete a stop string, so 400 tokens cost the same per token at the end as at
    the start once the text is longer than a stop string (the characters examined are
    counted, not timed)."""
    stops = [f"{i:02d}" + "z" * 1022 for i in range(64)]
    d = detok(stops)
    per_token = []
    for _ in range(1500):
        before = d.chars_examined
        d.apply(out("a"))
        per_token.append(d.chars_examined - before)
    assert d.stop_hit is None and len(d.text) == 1500
    # each stop string looks at most its own length back, the new character included
    assert max(per_token) <= 64 * 1024
    assert per_token[-1] == per_token[1100] == 64 * 1024


def test_token_texts_match_one_decode_per_id_in_one_batch_call(smollm2_path):
    """Each id's text as `decode([id])` gives it, special tokens and partial characters
    included, on SmolLM2's tokenizer (the `tokenizers` backend) and on the byte-level one
    (transformers' batch_decode); unseen ids are decoded together once, then remembered."""
    from transformers import AutoTokenizer

    smollm2 = AutoTokenizer.from_pretrained(smollm2_path)
    for tok in (smollm2, TOKENIZER):
        sample = tok.encode("Ça coûte 5 € 日本 🙂 <|im_end|> x", add_special_tokens=False)
        token_ids = [*sample, tok.eos_token_id, *sample[:3], 0, 1]
        texts = TokenTexts(tok)
        batches: list[int] = []

        def counted(seqs, inner=texts._decode_batch, batches=batches):
            batches.append(len(seqs))
            return inner(seqs)

        texts._decode_batch = counted
        assert texts(token_ids) == [tok.decode([t]) for t in token_ids]
        assert texts(token_ids[::-1]) == [tok.decode([t]) for t in token_ids[::-1]]
        assert batches == [len(set(token_ids))]


def test_the_text_grows_without_copying_what_was_handed_out():
    """What `take` handed out is kept in pieces; only a stop string's length but one stays
    pending, so each token appends to a short string however long the text (a growing
    string copied at every token took 10 s for 128k tokens) and `text` is still whole."""
    d = detok(["0123456789"])
    for i in range(5_000):
        d.apply(out("ab"))
        assert len(d._pending) == min(9, 2 * (i + 1))
    assert d.text == "ab" * 5_000 and d.stop_hit is None
    end = d.apply(out("x0123456789y", finish_reason="length"))
    assert (end.text, end.stop_reason) == ("bababababx", "0123456789")  # 9 held + x
    assert d.text == "ab" * 5_000 + "x"

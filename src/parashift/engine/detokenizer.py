"""Incremental detokenization: text grows token by token, correct across multi-byte
characters and tokenizers that merge spaces; stop strings are matched across token borders.
For streaming, `take` hands out only text that no stop string can still claim."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from parashift.types.outputs import EngineCoreOutput


@dataclass
class DetokenizedDelta:
    text: str  # newly final text
    finish_reason: str | None
    stop_reason: int | str | None
    abort: bool  # a stop string ended the sample before the engine did: abort it there


def _backend(tokenizer: Any) -> Any:
    """The `tokenizers` object behind a transformers tokenizer whose decode adds nothing to it
    (no clean-up of spaces), else None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "decode") and hasattr(backend, "decode_batch") \
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend
    return None


def decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text. A transformers tokenizer backed by `tokenizers` whose decode adds nothing
    (no clean-up of spaces) is asked directly: its decode wraps the same call in ~4 us of
    Python, twice per token here (6.0 against 2.3 us a token on SmolLM2's tokenizer)."""
    backend = _backend(tokenizer)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class TokenTexts:
    """Each token id's own text, as `tokenizer.decode([id])` gives it (logprob entries): the
    ids not seen before are decoded in one batch call and remembered, so a body of n x tokens
    x (1 + logprobs) entries costs one call per batch instead of one `decode` per entry."""

    def __init__(self, tokenizer: Any):
        backend = _backend(tokenizer)
        self._decode_batch: Callable[[list[list[int]]], list[str]] = (
            functools.partial(backend.decode_batch, skip_special_tokens=False)
            if backend is not None else tokenizer.batch_decode)
        self._known: dict[int, str] = {}

    def __call__(self, token_ids: list[int]) -> list[str]:
        missing = [t for t in dict.fromkeys(token_ids) if t not in self._known]
        if missing:
            texts = self._decode_batch([[t] for t in missing])
            self._known.update(zip(missing, texts, strict=True))
        return [self._known[t] for t in token_ids]


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool):
        self._decode = decoder(tokenizer, skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        # Decoding restarts a few tokens back so a token's leading space/merge is right.
        self.tokens = list(prompt_token_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        # The text is what `take` handed out (in pieces, joined only when `text` is read) and
        # what it has not: the held-back tail and the new text. Appending to one growing
        # string copies it every time (10 s for a 128k-token reply); the pending part stays
        # short, so the work is linear in the text.
        self._taken: list[str] = []
        self._pending = ""
        self.stop_hit: str | None = None
        self.chars_examined = 0  # by the stop-string search (tests bound it)
        self.emitted = 0  # characters handed out by `take`
        self.holdback = max((len(s) for s in stop), default=1) - 1

    @property
    def text(self) -> str:
        """The whole text so far (read when a sample ends)."""
        if len(self._taken) > 1:
            self._taken = ["".join(self._taken)]
        return "".join([*self._taken, self._pending])

    def update(self, new_token_ids: list[int]) -> None:
        """Append tokens (ignored once a stop string has ended the output)."""
        if self.stop_hit is not None:
            return
        before = self.emitted + len(self._pending)
        for token in new_token_ids:
            self.tokens.append(token)
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self._pending += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            if self.stop and self._check_stop(before):
                break

    def apply(self, out: EngineCoreOutput) -> DetokenizedDelta:
        """One engine delta: the text its tokens make final and how the sample ends. A stop
        string wins over the engine's own reason (e.g. length)."""
        self.update(out.new_token_ids)
        finish_reason, stop_reason, abort = out.finish_reason, out.stop_reason, False
        if self.stop_hit is not None:
            abort = finish_reason is None
            finish_reason, stop_reason = "stop", self.stop_hit
        return DetokenizedDelta(self.take(finished=finish_reason is not None), finish_reason,
                                stop_reason, abort)

    def take(self, finished: bool) -> str:
        """The text not handed out yet, minus a tail that could still start a stop string.
        When finished, bytes still waiting to complete a character are flushed as they are."""
        if finished and self.stop_hit is None and self.read_offset < len(self.tokens):
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            self._pending += self._decode(self.tokens[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.tokens)
        end = self.emitted + len(self._pending)
        if not finished and self.stop_hit is None:
            end = max(self.emitted, end - self.holdback)
        cut = end - self.emitted
        delta, self._pending, self.emitted = self._pending[:cut], self._pending[cut:], end
        if delta:
            self._taken.append(delta)
        return delta

    def _check_stop(self, before: int) -> bool:
        """Each stop string is looked for only where the new text (from `before` on) can have
        completed it: the work is linear in the new text, whatever the text so far. That
        window is never handed out yet (`take` holds back a stop string's length but one)."""
        best = None
        length = self.emitted + len(self._pending)
        for s in self.stop:
            start = max(0, before - len(s) + 1)
            self.chars_examined += length - start
            i = self._pending.find(s, max(0, start - self.emitted))  # where in the pending
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.stop_hit = s
        self._pending = self._pending[: i + len(s)] if self.include_stop else self._pending[:i]
        return True

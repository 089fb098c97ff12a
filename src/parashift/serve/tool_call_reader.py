"""A choice's tool calls read as its text grows (serve/tool_calls.py says what a request's
tools ask for; serve/tool_call_formats.py reads each form). One reader per choice keeps its
state between deltas: `feed` takes only the text new since the last call and returns what it
made known, so each character is examined a bounded number of times however long the reply
(`chars_examined` counts them; an 8k-token argument re-read whole at every delta cost about
24 s of event loop). The same reader serves whole replies (`read`) and streams: a stream sends
each call's name as soon as it is known, then its arguments (piece by piece for the
constrained forms, whole for a model's own format once its call is complete), never text that
may still turn out to be a call."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from parashift.serve.tool_calls import ToolPlan


@dataclass
class Call:
    name: str
    pieces: list[str] = field(default_factory=list)  # its arguments' JSON text, as it came
    complete: bool = False

    @property
    def arguments(self) -> str:
        return "".join(self.pieces)


@dataclass
class ToolEvent:
    kind: Literal["content", "call", "arguments"]  # text; a call opens; a piece of arguments
    text: str  # the content, the call's name or the piece
    index: int = 0  # the call's


class ToolCallReader:
    """Plain text: all of it is content. Subclasses read the tool formats."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.content: list[str] = []
        self.calls: list[Call] = []
        self.chars_examined = 0
        self._events: list[ToolEvent] = []

    def feed(self, text: str, final: bool) -> list[ToolEvent]:
        """The events `text` (new since the last call) makes known; `final` once the choice
        has ended (what was held back as a possible call start is content then)."""
        self._events = []
        self._feed(text, final)
        return self._events

    def read(self, text: str) -> tuple[str, list[Call]]:
        """A whole reply: its content and its calls."""
        self.feed(text, final=True)
        return "".join(self.content), self.calls

    def _feed(self, text: str, final: bool) -> None:
        self._say(text)

    def _say(self, text: str) -> None:
        if text:
            self.content.append(text)
            self._events.append(ToolEvent("content", text))

    def _open(self, name: str) -> None:
        self.calls.append(Call(name))
        self._events.append(ToolEvent("call", name, len(self.calls) - 1))

    def _add(self, piece: str) -> None:
        if piece:
            self.calls[-1].pieces.append(piece)
            self._events.append(ToolEvent("arguments", piece, len(self.calls) - 1))

    def _whole_call(self, obj: Any, arguments_key: str) -> bool:
        """A decoded call object, opened and complete at once; False if it is not one."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
        self._open(obj["name"])
        self._add(args if isinstance(args, str) else json.dumps(args))
        self.calls[-1].complete = True
        return True


class JsonEnd:
    """Where a JSON object or array ends, read piece by piece: brackets outside strings are
    counted (the text is the grammar's or the model's; nothing here checks it is JSON)."""

    _UNQUOTED = re.compile(r'["{}\[\]]')
    _QUOTED = re.compile(r'["\\]')

    def __init__(self) -> None:
        self.depth, self.quoted, self.escaped = 0, False, False

    def feed(self, text: str, start: int = 0) -> int | None:
        """Where the value ends in `text` (exclusive), or None if it is still open."""
        i = start
        while i < len(text):
            if self.escaped:
                self.escaped, i = False, i + 1
                continue
            m = (self._QUOTED if self.quoted else self._UNQUOTED).search(text, i)
            if m is None:
                return None
            ch, i = m.group(), m.end()
            if self.quoted:
                self.escaped, self.quoted = ch == "\\", ch == "\\"
            elif ch == '"':
                self.quoted = True
            elif ch in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return i
        return None


def held_prefix(text: str, tag: str) -> int:
    """How many trailing characters of `text` may begin `tag` (held back from the content)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0

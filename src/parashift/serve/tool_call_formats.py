"""Each form of tool calls read incrementally (serve/tool_call_reader.py): the constrained
forms of a named and a `required` tool_choice, and the model's own formats under `auto`
(hermes, llama3_json, mistral). Each keeps a state between deltas and looks again only at a
bounded tail (a tag's possible start, a call header); a call's text is decoded once, when
it closes."""

from __future__ import annotations

import json
import re

from parashift.serve.tool_call_reader import JsonEnd, ToolCallReader, held_prefix
from parashift.serve.tool_calls import ToolPlan


def reader_for(plan: ToolPlan) -> ToolCallReader:
    """A fresh reader for one choice of a request with this plan."""
    if plan.mode == "named":
        return _Named(plan)
    if plan.mode == "required":
        return _Required(plan)
    if plan.mode == "auto":
        return _PARSERS[plan.parser or "hermes"](plan)
    return ToolCallReader(plan)


class _Named(ToolCallReader):
    """The reply is the named function's arguments, complete once its object closes
    (max_tokens may cut it). What follows the object is dropped: the constraint allows only
    whitespace there, and arguments must stay one JSON object."""

    def __init__(self, plan: ToolPlan):
        super().__init__(plan)
        self._end = JsonEnd()

    def _feed(self, text: str, final: bool) -> None:
        if not self.calls:
            self._open(self.plan.name or "")
        call = self.calls[0]
        if call.complete or not text:
            return
        end = self._end.feed(text)
        self.chars_examined += len(text) if end is None else end
        call.complete = end is not None
        self._add(text[:end])


_REQUIRED_ITEM = re.compile(r'\{"name": "([^"]*)"(, "parameters": )?')
_ITEM_START = '{"name": "'
_PARAMETERS = ', "parameters": '
_MAX_HEADER = len(_ITEM_START) + 64 + 1 + len(_PARAMETERS)  # names are 1 to 64 characters


class _Required(ToolCallReader):
    """`[{"name": "f", "parameters": {...}}, ...]` as the `required` grammar writes it (its
    schema's order, these separators), read as far as it goes: a call opens once its name is
    known, its arguments follow piece by piece."""

    def __init__(self, plan: ToolPlan):
        super().__init__(plan)
        self._state = "start"  # start, header, arguments, close, separator, done
        self._item = ""  # an item's text before its arguments (at most _MAX_HEADER), or ","
        self._named = False  # the item's call is open
        self._end = JsonEnd()

    def _feed(self, text: str, final: bool) -> None:
        i = 0
        while i < len(text) and self._state != "done":
            i = getattr(self, "_on_" + self._state)(text, i)

    def _on_start(self, text: str, i: int) -> int:
        self.chars_examined += 1
        self._state = "header" if text[i] == "[" else "done"
        return i + 1

    def _on_header(self, text: str, i: int) -> int:
        before = len(self._item)
        self._item += text[i : i + _MAX_HEADER - before]
        self.chars_examined += len(self._item)  # at most _MAX_HEADER, once per delta
        taken = i + len(self._item) - before
        m = _REQUIRED_ITEM.match(self._item)
        if m is None:
            if not _ITEM_START.startswith(self._item[: len(_ITEM_START)]) or \
                    len(self._item) == _MAX_HEADER:
                self._state = "done"  # the array's end, or no item
            return taken
        if not self._named:
            self._open(m.group(1))
            self._named = True
        if m.group(2):
            self._state, self._item, self._named, self._end = "arguments", "", False, JsonEnd()
            return i + m.end() - before
        if len(self._item) >= m.end() + len(_PARAMETERS):
            self._state = "done"  # the name, then something else
        return taken

    def _on_arguments(self, text: str, i: int) -> int:
        end = self._end.feed(text, i)
        self.chars_examined += (len(text) if end is None else end) - i
        self._add(text[i:end])
        if end is None:
            return len(text)
        self.calls[-1].complete = True
        self._state = "close"
        return end

    def _on_close(self, text: str, i: int) -> int:  # the item's own closing brace
        self.chars_examined += 1
        self._state = "separator"
        return i + 1

    def _on_separator(self, text: str, i: int) -> int:
        self.chars_examined += 1
        if self._item == ",":  # ", " leads to the next item; "," then anything else ends
            self._state, self._item = ("header" if text[i] == " " else "done"), ""
            return i + 1
        if text[i] == ",":
            self._item = ","
            return i + 1
        self._state = "header"  # no separator: an item may follow directly
        return i


class _Tagged(ToolCallReader):
    """Content until `open_tag`; a tail that may begin the tag is held back until the reply
    ends or the tag is told apart."""

    open_tag = ""

    def __init__(self, plan: ToolPlan):
        super().__init__(plan)
        self._held = ""  # the content's tail that may begin open_tag

    def _content_until_tag(self, text: str, final: bool) -> int | None:
        """Says the content in `text`; where the text after the tag starts, or None."""
        s = self._held + text
        self.chars_examined += len(s)  # the held part: fewer than len(open_tag) characters
        start = s.find(self.open_tag)
        if start < 0:
            held = 0 if final else held_prefix(s, self.open_tag)
            self._say(s[: len(s) - held])
            self._held = s[len(s) - held :]
            return None
        self._say(s[:start])
        after = start + len(self.open_tag) - len(self._held)
        self._held = ""
        return after


class _Hermes(_Tagged):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, content around them."""

    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self, plan: ToolPlan):
        super().__init__(plan)
        self._body: list[str] | None = None  # inside a call: its text so far
        self._tail = ""  # the body's last characters, which may begin close_tag

    def _feed(self, text: str, final: bool) -> None:
        while True:
            if self._body is None:
                after = self._content_until_tag(text, final)
                if after is None:
                    return
                self._body, self._tail, text = [], "", text[after:]
            s = self._tail + text
            self.chars_examined += len(s)
            end = s.find(self.close_tag)
            if end < 0:
                self._body.append(text)
                self._tail = s[-(len(self.close_tag) - 1) :]
                if final:  # never closed: what it holds is text after all
                    self._say(self.open_tag + "".join(self._body))
                    self._body = None
                return
            joined = "".join(self._body) + text
            self.chars_examined += len(joined)  # joined and decoded once per call
            cut = len(joined) - len(text) - len(self._tail) + end  # where the body ends
            body, text = joined[:cut], joined[cut + len(self.close_tag) :]
            self._body = None
            try:
                is_call = self._whole_call(json.loads(body), "arguments")
            except ValueError:
                is_call = False
            if not is_call:
                self._say(self.open_tag + body + self.close_tag)


_PYTHON_TAG = "<|python_tag|>"


class _Llama3Json(ToolCallReader):
    """A reply that starts (after spaces and an optional `<|python_tag|>`) with `{` is calls:
    JSON objects `{"name": ..., "parameters": ...}` joined by `;`, read when it ends. Any
    other reply is content, sent as soon as its start tells it apart."""

    def __init__(self, plan: ToolPlan):
        super().__init__(plan)
        self._state = "lead"  # lead (undecided), content or calls
        self._text: list[str] = []  # the reply so far while not content
        self._head = ""  # the first characters after leading spaces (len(_PYTHON_TAG) + 1)

    def _feed(self, text: str, final: bool) -> None:
        if self._state == "content":
            self._say(text)
            return
        self._text.append(text)
        if self._state == "lead":
            piece = text if self._head else text.lstrip()
            self._head += piece[: len(_PYTHON_TAG) + 1 - len(self._head)]
            self.chars_examined += len(text) + len(self._head)  # the spaces, then the head
            self._state = self._decide(final)
            if self._state == "content":
                self._say("".join(self._text))
                self._text = []
                return
        if self._state == "calls" and final:
            self._read_calls("".join(self._text))

    def _decide(self, final: bool) -> str:
        tagged = self._head.startswith(_PYTHON_TAG)
        rest = self._head[len(_PYTHON_TAG) :] if tagged else self._head
        if rest.startswith("{"):
            return "calls"
        # only spaces so far, the tag alone, or what may still become the tag
        undecided = rest == "" or (not tagged and _PYTHON_TAG.startswith(rest))
        return "lead" if undecided and not final else "content"

    def _read_calls(self, text: str) -> None:
        self.chars_examined += len(text)
        objects = []
        for part in text.strip().removeprefix(_PYTHON_TAG).split(";"):
            try:
                obj = json.loads(part)
            except ValueError:
                obj = None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                self._say(text)  # not calls after all
                return
            objects.append(obj)
        for obj in objects:
            self._whole_call(obj, "parameters")


class _Mistral(_Tagged):
    """`[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]` after the content; what follows
    the array is dropped. A tag without an array is content once the reply ends."""

    open_tag = "[TOOL_CALLS]"

    def __init__(self, plan: ToolPlan):
        super().__init__(plan)
        # content, lead (spaces after the tag), array, other (no array), done (calls read),
        # plain (the array was no calls: all the rest is content)
        self._state = "content"
        self._after: list[str] = []  # the text after the tag
        self._after_len = 0
        self._array_start = 0  # where the array starts in the joined _after
        self._end = JsonEnd()

    def _feed(self, text: str, final: bool) -> None:
        if self._state == "plain":
            self._say(text)
            return
        if self._state == "content":
            after = self._content_until_tag(text, final)
            if after is None:
                return
            self._state, text = "lead", text[after:]
        if self._state == "done":
            return
        self._after.append(text)
        self._after_len += len(text)
        if self._state == "lead":
            stripped = text.lstrip()
            self.chars_examined += len(text) - len(stripped)
            if stripped:
                self._array_start = self._after_len - len(stripped)
                self._state = "array" if stripped[0] == "[" else "other"
                text = stripped
        if self._state == "array":
            end = self._end.feed(text)
            self.chars_examined += len(text) if end is None else end
            if end is not None:
                self._read_array("".join(self._after), end - len(text))
                return
        if final:  # the tag began no complete array: it was content
            self._say(self.open_tag + "".join(self._after))
            self._state = "done"

    def _read_array(self, after: str, end_from_last: int) -> None:
        """`end_from_last`: where the array ends, counted back from the end of `after`."""
        array = after[self._array_start : len(after) + end_from_last]
        self.chars_examined += len(after)
        self._state = "done"
        try:
            items = json.loads(array)
            for item in items:
                self._whole_call(item, "arguments")
        except (ValueError, TypeError):
            self._say(self.open_tag + after)
            self._state = "plain"


_PARSERS = {"hermes": _Hermes, "llama3_json": _Llama3Json, "mistral": _Mistral}

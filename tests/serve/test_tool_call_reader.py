"""The tool-call readers on their own (serve/tool_call_reader.py, serve/tool_call_formats.py):
each form read whole and fed in pieces of every size gives the same content and calls; a
stream's events only extend what came before; and the characters examined grow linearly with
the text, whatever its length (counted, not timed: the old reader re-read the whole text at
every delta)."""

from __future__ import annotations

import json

import pytest

from parashift.serve.tool_call_formats import reader_for
from parashift.serve.tool_call_reader import ToolCallReader
from parashift.serve.tool_calls import ToolPlan

PLANS = {
    "named": ToolPlan("named", name="f"),
    "required": ToolPlan("required"),
    "hermes": ToolPlan("auto", parser="hermes"),
    "llama3_json": ToolPlan("auto", parser="llama3_json"),
    "mistral": ToolPlan("auto", parser="mistral"),
    "none": ToolPlan("none"),
}


def _read(form: str, text: str, final: bool = True):
    reader = reader_for(PLANS[form])
    reader.feed(text, final)
    return "".join(reader.content), [(c.name, json.loads(c.arguments)) for c in reader.calls]


def _fed(form: str, text: str, size: int) -> ToolCallReader:
    reader = reader_for(PLANS[form])
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        reader.feed(piece, final=k == len(pieces) - 1)
    return reader


def _result(reader: ToolCallReader):
    return ("".join(reader.content),
            [(c.name, c.arguments, c.complete) for c in reader.calls])


def test_hermes_holds_back_what_may_open_a_call():
    assert _read("hermes", "Hi <tool_c", final=False) == ("Hi ", [])
    assert _read("hermes", "Hi <tool_c") == ("Hi <tool_c", [])
    assert _read("hermes", 'a<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>b'
                           '<tool_call>{"name": "g", "arguments": {}}</tool_call>') == (
        "ab", [("f", {"x": 1}), ("g", {})])
    assert _read("hermes", "<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])
    assert _read("hermes", 'x<tool_call>{"name": "f"') == ('x<tool_call>{"name": "f"', [])


def test_llama3_json_and_mistral():
    assert _read("llama3_json", '{"name": "f", "parameters": {"a": 2}}; '
                                '{"name": "g", "parameters": {}}') == (
        "", [("f", {"a": 2}), ("g", {})])
    assert _read("llama3_json", '{"name": "f", "par', final=False) == ("", [])
    assert _read("llama3_json", "plain text") == ("plain text", [])
    assert _read("llama3_json", ' <|python_tag|>{"name": "f", "parameters": {}}') == (
        "", [("f", {})])
    assert _read("llama3_json", "<|python", final=False) == ("", [])
    assert _read("mistral", 'ok [TOOL_CALLS][{"name": "f", "arguments": {"q": "a]"}}]') == (
        "ok ", [("f", {"q": "a]"})])
    assert _read("mistral", "[TOOL_CALLS][{", final=False) == ("", [])
    assert _read("mistral", "[TOOL_CALLS] nothing") == ("[TOOL_CALLS] nothing", [])
    assert _read("mistral", "[TOOL_CALLS][oops] [TOOL_CALLS]") == (
        "[TOOL_CALLS][oops] [TOOL_CALLS]", [])


def test_a_named_call_is_complete_once_its_object_closes():
    assert not reader_for(PLANS["named"]).read('{"a": 1')[1][0].complete  # cut by max_tokens
    assert reader_for(PLANS["named"]).read('{"a": "}\\"{"}')[1][0].complete


def test_a_named_call_ends_with_its_object():
    """What follows the arguments' object (whitespace the constraint allows, or anything a
    model without one writes) is dropped, in one piece or across deltas."""
    content, calls = reader_for(PLANS["named"]).read('{"a": 1}\n  trailing {"b": 2}')
    assert (content, calls[0].arguments, calls[0].complete) == ("", '{"a": 1}', True)
    reader = reader_for(PLANS["named"])
    events = [e for piece in ('{"a": [1', ']} ', 'x}', "") for e in reader.feed(piece, False)]
    assert [(e.kind, e.text) for e in events] == [("call", "f"), ("arguments", '{"a": [1'),
                                                  ("arguments", "]}")]
    assert reader.calls[0].arguments == '{"a": [1]}' and reader.calls[0].complete


TEXTS = {
    "named": ['{"a": [1, 2, {"b": "}\\\\\\"]"}], "c": "x"}', '{"a": 1'],
    "required": ['[{"name": "f", "parameters": {"s": "}{\\""}}, {"name": "g", '
                 '"parameters": {}}]', '[{"name": "f", "par', '[{"name": "f", "parameters": '
                 '{"a": [1, 2', "nope", "[]"],
    "hermes": ['Sure <tool_call>{"name": "f", "arguments": {"x": "</tool"}}</tool_call> and '
               '<tool_call>{"name": "g", "arguments": {}}</tool_call>!', "<tool_call>[1]"
               "</tool_call><tool_", "plain < text <tool_call>never closed"],
    "llama3_json": ['  <|python_tag|>{"name": "f", "parameters": {"a": ";"}}',
                    '{"name": "f", "parameters": {}};{"name": "g", "parameters": {"b": 1}}',
                    "<|py and more", "   \n  ", "{not json"],
    "mistral": ['Hi [TOOL_CALLS]  [{"name": "f", "arguments": {"a": "]["}}] tail',
                "[TOOL_CA", "a [TOOL_CALLS] {", '[TOOL_CALLS][{"name": "f", "arguments": {'],
    "none": ["anything <tool_call> at all"],
}


@pytest.mark.parametrize("form", TEXTS)
def test_every_piece_size_reads_as_the_whole(form):
    for text in TEXTS[form]:
        whole = _result(_fed(form, text, max(1, len(text))))
        for size in range(1, 8):
            assert _result(_fed(form, text, size)) == whole, (form, text, size)


@pytest.mark.parametrize("form", ["named", "required", "hermes", "mistral"])
def test_a_streams_events_rebuild_the_reply_and_only_extend_it(form):
    text = TEXTS[form][0]
    reader = reader_for(PLANS[form])
    content, names, arguments = "", [], []
    for i in range(len(text)):
        for event in reader.feed(text[i], final=i == len(text) - 1):
            if event.kind == "content":
                content += event.text
            elif event.kind == "call":
                assert event.index == len(names)  # each call opens once, in order
                names.append(event.text)
                arguments.append("")
            else:
                assert event.text and event.index < len(names)
                arguments[event.index] += event.text
    assert (content, names, arguments) == ("".join(reader.content),
                                           [c.name for c in reader.calls],
                                           [c.arguments for c in reader.calls])
    assert names and all(c.complete for c in reader.calls)


def _long_reply(form: str, num_items: int) -> str:
    """A reply whose one call has an argument of `num_items` array items."""
    array = json.dumps({"values": [f"s{i}\\" for i in range(num_items)]})
    return {"named": array,
            "required": f'[{{"name": "f", "parameters": {array}}}]',
            "hermes": f'ok <tool_call>{{"name": "f", "arguments": {array}}}</tool_call>',
            "llama3_json": f'{{"name": "f", "parameters": {array}}}',
            "mistral": f'ok [TOOL_CALLS][{{"name": "f", "arguments": {array}}}]'}[form]


@pytest.mark.parametrize("form", ["named", "required", "hermes", "llama3_json", "mistral"])
def test_characters_examined_grow_linearly(form):
    """Fed 3 characters at a time (a token's worth), a reply 8 times longer costs 8 times the
    characters examined, and a few per character at most: each is looked at a bounded number
    of times (the few characters that may begin a closing tag again at each delta: hermes
    examines about 5.7 per character here)."""
    examined = {}
    for num_items in (500, 4000):
        text = _long_reply(form, num_items)
        reader = _fed(form, text, 3)
        assert reader.calls and reader.calls[0].complete
        assert json.loads(reader.calls[0].arguments)["values"][-1] == f"s{num_items - 1}\\"
        examined[num_items] = reader.chars_examined / len(text)
    assert examined[4000] <= 8 and examined[4000] <= examined[500] * 1.05, examined

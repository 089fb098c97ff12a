"""Tool calling for chat completions, as OpenAI and vLLM define it.

`tool_choice` picks how the reply's tool calls come about:
- `none`: plain text (the chat template still sees the tools);
- a named function: the reply is constrained to that function's parameter schema, and is its
  arguments;
- `required`: constrained to a JSON array of calls, each `{"name": ..., "parameters": ...}`
  with one of the tools' names and that tool's parameter schema (one call only without
  `parallel_tool_calls`), as vLLM builds it: the arguments always validate;
- `auto` (the default with tools, under `--enable-auto-tool-choice`): the model writes its
  own tool format, read by the parser `--tool-call-parser` names: `hermes`
  (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, Qwen2.5/Qwen3, SmolLM2),
  `llama3_json` (a JSON object `{"name": ..., "parameters": ...}`, several joined by `;`) or
  `mistral` (`[TOOL_CALLS][{"name": ..., "arguments": ...}]`).

Each choice's text is read again as it grows (`ToolCallReader.read`), so the same code serves
whole replies and streams: a stream sends each call's id and name as soon as they are known,
then its arguments (piece by piece for the constrained forms, whole for a model's own format
once its call is complete), never text that may still turn out to be a call."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from parashift.serve.openai_protocol import ChatCompletionRequest, OpenAIError
from parashift.types.structured_outputs import StructuredOutputsParams

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


@dataclass
class ToolPlan:
    """What a chat request's tools ask for: `mode` none, named, required or auto."""

    mode: str
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's form, for templates
    name: str | None = None  # the named function
    constraint: StructuredOutputsParams | None = None
    parser: str | None = None  # auto: the --tool-call-parser


def tool_plan(req: ChatCompletionRequest, parser: str | None) -> ToolPlan:
    """Checks `tools` and `tool_choice` (a 400 naming the field) and says what they ask for.
    `parser`: the server's --tool-call-parser under --enable-auto-tool-choice, or None."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    tools, schemas = [], {}
    for i, tool in enumerate(req.tools):
        fn = tool.function
        if not _NAME.fullmatch(fn.name):
            raise OpenAIError(400, f"tools[{i}].function.name {fn.name!r}: use 1 to 64 of "
                              "a-z, A-Z, 0-9, _ . -", param="tools")
        if fn.name in schemas:
            raise OpenAIError(400, f"tools[{i}]: a second function named {fn.name!r}",
                              param="tools")
        params = fn.parameters if fn.parameters is not None else {
            "type": "object", "properties": {}}
        if params.get("type") != "object":
            raise OpenAIError(400, f"tools[{i}].function.parameters must be a JSON schema of "
                              'type "object"', param="tools")
        schemas[fn.name] = params
        tools.append({"type": "function", "function": {
            "name": fn.name, "description": fn.description or "", "parameters": params}})
    if choice is None:
        choice = "auto" if parser else "none"
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if parser is None:
            raise OpenAIError(400, '"auto" tool choice needs the server started with '
                              "--enable-auto-tool-choice and --tool-call-parser",
                              param="tool_choice")
        return ToolPlan("auto", tools, parser=parser)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in schemas.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if req.parallel_tool_calls is False:
            array["maxItems"] = 1
        return ToolPlan("required", tools, constraint=_constraint(array))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("function"), dict) and isinstance(choice["function"].get("name"), str):
        name = choice["function"]["name"]
        if name not in schemas:
            raise OpenAIError(400, f"tool_choice names {name!r}, which is not among the tools",
                              param="tool_choice")
        return ToolPlan("named", tools, name, _constraint(schemas[name]))
    raise OpenAIError(400, 'tool_choice must be "none", "auto", "required" or {"type": '
                      '"function", "function": {"name": ...}}', param="tool_choice")


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as e:  # a keyword the grammar would not enforce
        raise OpenAIError(400, f"tools: {e}", param="tools") from None


@dataclass
class Call:
    name: str
    arguments: str  # JSON text, as far as it is known
    complete: bool


class ToolCallReader:
    """One choice's text -> (its content, its calls): `read(text, final)` with the whole text
    so far; `final` once the choice has ended (what was held back as a possible call start
    is content then)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan

    def read(self, text: str, final: bool) -> tuple[str, list[Call]]:
        mode = self.plan.mode
        if mode == "named":  # complete once its object closes (max_tokens may cut it)
            return "", [Call(self.plan.name or "", text, _json_value_end(text, 0) is not None)]
        if mode == "required":
            return "", _required_calls(text)
        if mode == "auto":
            return _PARSERS[self.plan.parser or "hermes"](text, final)
        return text, []


def _json_value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array at `start` ends (exclusive), or None if it is open."""
    depth, quoted, i = 0, False, start
    while i < len(text):
        ch = text[i]
        if quoted:
            if ch == "\\":
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


_REQUIRED_ITEM = re.compile(r'\{"name": "([^"]*)"(, "parameters": )?')


def _required_calls(text: str) -> list[Call]:
    """`[{"name": "f", "parameters": {...}}, ...]` as the `required` grammar writes it (its
    schema's order, compact separators), read as far as it goes."""
    calls, at = [], 1 if text.startswith("[") else len(text)
    while at < len(text):
        m = _REQUIRED_ITEM.match(text, at)
        if m is None:
            break
        if not m.group(2):  # the name is known, its arguments not begun
            calls.append(Call(m.group(1), "", False))
            break
        start = m.end()
        end = _json_value_end(text, start)
        calls.append(Call(m.group(1), text[start:end or len(text)], end is not None))
        if end is None:
            break
        at = end + 1 + (2 if text.startswith(", ", end + 1) else 0)
    return calls


def _held_prefix(text: str, tag: str) -> int:
    """How many trailing characters of `text` may begin `tag` (held back from the content)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _decoded(obj: Any, arguments_key: str) -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args), True)


def _hermes(text: str, final: bool) -> tuple[str, list[Call]]:
    content, calls, at = [], [], 0
    while True:
        start = text.find("<tool_call>", at)
        if start < 0:
            tail = text[at:]
            held = 0 if final else _held_prefix(tail, "<tool_call>")
            content.append(tail[:len(tail) - held])
            break
        content.append(text[at:start])
        end = text.find("</tool_call>", start)
        if end < 0:
            if final:  # never closed: what it holds is text after all
                content.append(text[start:])
            break
        body = text[start + len("<tool_call>"):end]
        try:
            call = _decoded(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            content.append(text[start:end + len("</tool_call>")])
        else:
            calls.append(call)
        at = end + len("</tool_call>")
    return "".join(content), calls


def _llama3_json(text: str, final: bool) -> tuple[str, list[Call]]:
    body = text.strip()
    body = body.removeprefix("<|python_tag|>")
    if not body.startswith("{"):
        return ("" if not final and "<|python_tag|>".startswith(text.strip()) else text), []
    if not final:
        return "", []  # a call until the reply ends
    calls = []
    for part in body.split(";"):
        try:
            call = _decoded(json.loads(part), "parameters")
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return "", calls


def _mistral(text: str, final: bool) -> tuple[str, list[Call]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        held = 0 if final else _held_prefix(text, "[TOOL_CALLS]")
        return text[:len(text) - held], []
    content = text[:start]
    body = text[start + len("[TOOL_CALLS]"):].strip()
    end = _json_value_end(body, 0) if body.startswith("[") else None
    if end is None:
        return (content + text[start:] if final else content), []
    try:
        items = json.loads(body[:end])
        calls = [call for item in items if (call := _decoded(item, "arguments")) is not None]
    except (ValueError, TypeError):
        return text, []
    return content, calls


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The history as chat templates take it: an assistant's `tool_calls` with their arguments
    decoded (templates write them as JSON themselves), a tool result with its call's id."""
    out = []
    for i, m in enumerate(messages):
        item: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        for call in m.get("tool_calls") or []:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                raise OpenAIError(400, f"messages[{i}].tool_calls: the arguments of "
                                  f"{call.function.name!r} are not JSON",
                                  param="messages") from None
            item.setdefault("tool_calls", []).append({
                "id": call.id, "type": "function",
                "function": {"name": call.function.name, "arguments": arguments}})
        if m.get("tool_call_id") is not None:
            item["tool_call_id"] = m["tool_call_id"]
        out.append(item)
    return out

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

Each choice's calls are read as its text grows, by serve/tool_call_formats.py."""

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

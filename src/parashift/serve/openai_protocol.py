"""OpenAI request bodies as typed structs, their validation, and OpenAI-style errors."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from parashift.types.sampling_params import MAX_STOP_CHARS, MAX_STOPS, SamplingParams
from parashift.types.structured_outputs import StructuredOutputsParams


class OpenAIError(Exception):
    """Becomes an HTTP response with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# Documented limits (README "Serving"): past them a request is a 400 naming the field.
MAX_N = 128  # samples per prompt (n, best_of)
MAX_CHOICES = 256  # prompts x n in one request
MAX_LOGPROBS = 20  # OpenAI's own cap
MAX_PROMPTS = MAX_CHOICES  # prompts in one completion request, counted before tokenizing
MAX_MESSAGES = 4096  # messages in one chat request, counted before rendering
MAX_TOOLS = 128  # tools in a request, tool calls in a message
INT64 = (-(2**63), 2**63 - 1)
INT32_MAX = 2**31 - 1

Int64 = Annotated[int, Meta(ge=INT64[0], le=INT64[1])]
TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Count = Annotated[int, Meta(le=MAX_N)]  # the lower bound is SamplingParams' (its message)
Int32 = Annotated[int, Meta(le=INT32_MAX)]  # max_tokens, top_k (lower bounds: SamplingParams)
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
# Finite floats: JSON's 1e999 decodes to inf, which no sampler should see.
Float = Annotated[float, Meta(ge=-1e6, le=1e6)]
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
Stops = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOPS)]


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A field unknown to both OpenAI and parashift is a 400 naming it (vLLM's strict mode):
    a typo such as `max_token` must not be silently ignored."""


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; accepted, not used


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None  # the schema is always followed exactly here


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` field: exactly one constraint."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _Sampling(_Strict, kw_only=True):
    model: str | None = None
    n: Count = 1
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int32 | None = None  # vLLM's extra sampling fields, as vLLM names them
    min_p: Float | None = None
    seed: Int64 | None = None
    stop: Stops | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOPS)] | None = None
    ignore_eos: bool = False
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    user: str | None = None
    # OpenAI's fields that change nothing here: accepted and ignored.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # text, texts, token ids, or lists of token ids (checked by `completion_prompts`)
    prompt: str | list[str | TokenId | list[TokenId]]
    max_tokens: Int32 | None = 16
    logprobs: Logprobs | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Count | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None
    image_url: Any = None  # OpenAI's other part kinds: known, refused by `message_text`
    input_audio: Any = None
    file: Any = None
    refusal: str | None = None


class FunctionCallIn(_Strict):
    name: str
    arguments: str  # JSON text


class ToolCallIn(_Strict):
    id: str
    function: FunctionCallIn
    type: Literal["function"] = "function"


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type "object"
    strict: bool | None = None  # the schema is always followed exactly here


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Meta(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(max_length=MAX_MESSAGES)]
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    parallel_tool_calls: bool | None = None
    tools: Annotated[list[ToolDef], Meta(max_length=MAX_TOOLS)] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    # OpenAI's fields for what this server does not do: a 400 naming them when set (below).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None


# Unsupported OpenAI fields and the values that still mean "not used".
_UNSUPPORTED = {
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
}


def check_supported(req: ChatCompletionRequest) -> None:
    for name, unused in _UNSUPPORTED.items():
        if getattr(req, name) not in unused:
            raise OpenAIError(400, f"{name} is not supported by this server", param=name)


def parse(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise OpenAIError(400, f"invalid request: {e}", param=_field_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise OpenAIError(400, f"the body is not valid JSON: {e}") from None


def _field_of(error: str) -> str | None:
    """msgspec's "... - at `$.messages[0].role`" -> "messages"; "unknown field `x`" -> "x"."""
    unknown = re.search(r"unknown field `([^`]+)`", error)
    if unknown:
        return unknown.group(1)
    at = re.search(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)", error)
    return at.group(1) if at else None


def message_text(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text":
            raise OpenAIError(400, f"content part type {part.type!r} is not supported "
                              "(only 'text')", param="messages")
        parts.append(part.text or "")
    return "".join(parts)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The history: role and text, an assistant's `tool_calls`, a tool result's
    `tool_call_id` (serve/tool_calls.py `template_messages` readies them for templates)."""
    if not req.messages:
        raise OpenAIError(400, "messages must not be empty", param="messages")
    check_supported(req)
    out: list[dict[str, Any]] = []
    for m in req.messages:
        if m.function_call or m.audio:
            raise OpenAIError(400, "function_call and audio in messages are not supported "
                              "(tool_calls are)", param="messages")
        if m.role == "developer":  # OpenAI's newer name for the system role
            m = msgspec.structs.replace(m, role="system")
        if m.role not in ("system", "user", "assistant", "tool"):
            raise OpenAIError(400, f"message role must be system, user, assistant or tool, "
                              f"got {m.role!r}", param="messages")
        if m.tool_calls and m.role != "assistant":
            raise OpenAIError(400, "only assistant messages carry tool_calls",
                              param="messages")
        if m.role == "tool" and not m.tool_call_id:
            raise OpenAIError(400, "a tool message needs the tool_call_id it answers",
                              param="messages")
        item: dict[str, Any] = {"role": m.role, "content": message_text(m)}
        if m.tool_calls:
            item["tool_calls"] = m.tool_calls
        if m.role == "tool":
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def sampling_params(req: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                    max_model_len: int) -> SamplingParams:
    """The engine's SamplingParams for one prompt; raises OpenAIError(400) on bad values."""
    if req.logit_bias:
        raise OpenAIError(400, "logit_bias is not supported", param="logit_bias")
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:  # (logprobs and top_logprobs are bounded by their types above)
        max_tokens = req.max_tokens
        num_logprobs = req.logprobs
    room = max_model_len - num_prompt_tokens
    if room < 1 and max_tokens is None:
        raise OpenAIError(400, f"this model's maximum context length is {max_model_len} "
                          f"tokens; the prompt has {num_prompt_tokens} tokens, which leaves no "
                          "room to generate", param="messages" if isinstance(
                              req, ChatCompletionRequest) else "prompt")
    if max_tokens is None:
        max_tokens = room
    if num_prompt_tokens + max_tokens > max_model_len:
        raise OpenAIError(
            400, f"this model's maximum context length is {max_model_len} tokens; the prompt "
            f"has {num_prompt_tokens} tokens and max_tokens is {max_tokens} "
            f"({num_prompt_tokens + max_tokens} in total)", param="max_tokens")
    values = {
        "n": req.n, "max_tokens": max_tokens, "seed": req.seed, "stop": req.stop,
        "stop_token_ids": req.stop_token_ids or [], "ignore_eos": req.ignore_eos,
        "logprobs": num_logprobs,
    }
    for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("min_p", 0.0),
                          ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        value = getattr(req, name)
        values[name] = default if value is None else value
    values["structured_outputs"] = structured_outputs(req)
    try:
        return SamplingParams(**values)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise OpenAIError(400, str(e), param=param) from None


def structured_outputs(req: CompletionRequest | ChatCompletionRequest
                       ) -> StructuredOutputsParams | None:
    """The request's constraint, from `response_format` (OpenAI) or `structured_outputs`
    (vLLM); its compile is checked apart (a 400 naming the field)."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise OpenAIError(400, "give response_format or structured_outputs, not both",
                          param="structured_outputs")
    try:
        if so is not None:
            return StructuredOutputsParams(
                json=so.json if not isinstance(so.json, str) else _schema_text(so.json),
                regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object))
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise OpenAIError(400, "response_format json_schema needs json_schema.schema",
                              param="response_format")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)
    except ValueError as e:
        raise OpenAIError(400, str(e), param="structured_outputs" if so is not None
                          else "response_format") from None


def _schema_text(text: str) -> str:
    try:
        if not isinstance(json.loads(text), dict):
            raise ValueError
    except ValueError:
        raise OpenAIError(400, "structured_outputs.json must be a JSON schema object",
                          param="structured_outputs") from None
    return text

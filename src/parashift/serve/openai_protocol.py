"""OpenAI request bodies as typed structs, their validation, and OpenAI-style errors."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from parashift.types.sampling_params import MAX_STOP_CHARS, MAX_STOPS


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
MAX_CACHE_SALT_CHARS = 1024  # hashed into a prompt's first KV block
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
    # vLLM's: prefix-cache blocks are shared only between requests with the same salt
    cache_salt: Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
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
    except RecursionError:  # a value nested past the interpreter's limit (in a schema's dict)
        raise OpenAIError(400, "the body nests its values too deeply") from None


def _field_of(error: str) -> str | None:
    """msgspec's "... - at `$.messages[0].role`" -> "messages"; "unknown field `x`" -> "x"."""
    unknown = re.search(r"unknown field `([^`]+)`", error)
    if unknown:
        return unknown.group(1)
    at = re.search(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)", error)
    return at.group(1) if at else None

"""OpenAI request bodies as typed structs, their validation, and OpenAI-style errors."""

from __future__ import annotations

import msgspec

from parashift.types.sampling_params import SamplingParams


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


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # text, texts, token ids, or lists of token ids (checked by `completion_prompts`)
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def parse(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise OpenAIError(400, f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise OpenAIError(400, f"the body is not valid JSON: {e}") from None


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


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    if not req.messages:
        raise OpenAIError(400, "messages must not be empty", param="messages")
    out = []
    for m in req.messages:
        if m.role not in ("system", "user", "assistant"):
            raise OpenAIError(400, f"message role must be system, user or assistant, got "
                              f"{m.role!r}", param="messages")
        out.append({"role": m.role, "content": message_text(m)})
    return out


def sampling_params(req: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                    max_model_len: int) -> SamplingParams:
    """The engine's SamplingParams for one prompt; raises OpenAIError(400) on bad values."""
    if req.logit_bias:
        raise OpenAIError(400, "logit_bias is not supported", param="logit_bias")
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise OpenAIError(400, "top_logprobs must be between 0 and 20", param="top_logprobs")
    else:
        max_tokens = req.max_tokens
        num_logprobs = req.logprobs
        if num_logprobs is not None and not 0 <= num_logprobs <= 20:
            raise OpenAIError(400, "logprobs must be between 0 and 20", param="logprobs")
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
    try:
        return SamplingParams(**values)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise OpenAIError(400, str(e), param=param) from None

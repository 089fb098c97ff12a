"""An OpenAI request as the engine takes it: the chat history as templates read it, one
SamplingParams per prompt, and the output constraint (`response_format` or vLLM's
`structured_outputs`); bad values are a 400 naming the field."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import msgspec

from parashift.engine.structured_output import CompilesBusy, Grammars
from parashift.serve.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIError,
    check_supported,
)
from parashift.serve.overload import RetryLaterError
from parashift.types.sampling_params import SamplingParams
from parashift.types.structured_outputs import TOO_DEEP, StructuredOutputsParams


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
        "logprobs": num_logprobs, "cache_salt": req.cache_salt,
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


def constrained(req: CompletionRequest | ChatCompletionRequest,
                params: list[SamplingParams], tool_constraint: StructuredOutputsParams | None
                ) -> tuple[list[SamplingParams], str | None]:
    """The params with the constraint a `required` or named tool_choice implies, and the
    field a constraint that does not compile is reported on (None: no constraint)."""
    if tool_constraint is not None:
        if params[0].structured_outputs is not None:
            raise OpenAIError(400, "this tool_choice constrains the reply: give no "
                              "response_format or structured_outputs with it",
                              param="tool_choice")
        return [dataclasses.replace(p, structured_outputs=tool_constraint)
                for p in params], "tools"
    if params[0].structured_outputs is None:
        return params, None
    return params, "structured_outputs" if req.structured_outputs else "response_format"


async def check_compiles(grammars: Grammars, constraint: StructuredOutputsParams,
                         param: str) -> None:
    """A 400 naming `param` for a constraint that does not compile, or not within the time
    limit (the compile process kills it then: engine/grammar_worker.py); a 429 with
    Retry-After while too many compiles wait; a 503 if the compile process never answers
    (hung at its start): no request waits longer than Grammars.max_wait_s."""
    try:
        async with asyncio.timeout(grammars.max_wait_s):
            (await asyncio.wrap_future(grammars.compile(constraint))).check()
    except CompilesBusy as e:
        raise RetryLaterError(str(e), e.retry_after) from None
    except ValueError as e:
        raise OpenAIError(400, str(e), param=param) from None
    except TimeoutError:
        raise OpenAIError(503, f"the {constraint.kind} constraint was not checked: the "
                          "grammar compile process does not answer",
                          "service_unavailable") from None


def _schema_text(text: str) -> str:
    try:
        if not isinstance(json.loads(text), dict):
            raise ValueError
    except ValueError:
        raise OpenAIError(400, "structured_outputs.json must be a JSON schema object",
                          param="structured_outputs") from None
    except RecursionError:
        raise OpenAIError(400, TOO_DEEP, param="structured_outputs") from None
    return text

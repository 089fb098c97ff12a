"""One request's output budget: n x (max_tokens + echoed prompt) x (1 + logprobs), summed over
its prompts, at most --max-request-output-units. A unit is a token, or one logprob alternative
of a token, that the server keeps until the request ends and writes into its response: the
budget bounds a request's memory and the work of building its body, which `n`, `max_tokens`
and `logprobs` capped one by one do not (n=32, max_tokens=512, logprobs=20 made a 9 MB body).
Beyond it, a 400 names the product and its fields."""

from __future__ import annotations

from parashift.serve.openai_protocol import (
    MAX_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
)
from parashift.types.sampling_params import SamplingParams


def default_output_units(max_model_len: int) -> int:
    """The budget when no flag sets one: one sample that fills the whole context with every
    logprob (the largest request a single sample can make) always fits; n samples share it.
    With an 8k context that is 172,032 units: n=8 of a full context without logprobs fit,
    n=32 x 512 tokens x 20 logprobs (344,064) does not."""
    return max_model_len * (1 + MAX_LOGPROBS)


def output_units(params: list[SamplingParams], echoed: list[int]) -> int:
    """n x (max_tokens + echoed prompt tokens) x (1 + logprobs), summed over the prompts;
    `params` have max_tokens resolved (unset: what the context leaves after the prompt)."""
    return sum(sp.n * ((sp.max_tokens or 0) + echo) * (1 + (sp.logprobs or 0))
               for sp, echo in zip(params, echoed, strict=True))


def check_output_budget(req: CompletionRequest | ChatCompletionRequest,
                        prompts: list[list[int]], params: list[SamplingParams],
                        limit: int | None, max_model_len: int) -> None:
    """A 400 naming n, max_tokens, logprobs (or top_logprobs) and echo when the request's
    output units exceed `limit` (None: `default_output_units`). The error's `param` is n when
    several samples are asked for (the factor most often raised), else max_tokens."""
    budget = limit if limit is not None else default_output_units(max_model_len)
    chat = isinstance(req, ChatCompletionRequest)
    echo = not chat and req.echo
    echoed = [len(p) if echo else 0 for p in prompts]
    units = output_units(params, echoed)
    if units <= budget:
        return
    n, num_logprobs = params[0].n, params[0].logprobs or 0  # the same for every prompt
    tokens = sum((sp.max_tokens or 0) + e for sp, e in zip(params, echoed, strict=True))
    given = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    max_tokens = f"max_tokens={given}" if given is not None else (
        "max_tokens unset: the room the context leaves")
    parts = [max_tokens] + (["echo: the prompt's tokens"] if echo else []) + (
        [f"over {len(prompts)} prompts"] if len(prompts) > 1 else [])
    logprobs = "top_logprobs" if chat else "logprobs"
    raise OpenAIError(
        400, f"n={n} x {tokens} tokens ({', '.join(parts)}) x (1 + {logprobs}={num_logprobs}) "
        f"= {units:,} output units, more than this server's budget of {budget:,} per request "
        f"(--max-request-output-units); lower n, max_tokens or {logprobs}"
        + (", or drop echo" if echo else ""),
        param="n" if n > 1 else "max_tokens")

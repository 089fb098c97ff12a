"""The response formatters on their own (serve/responses.py), fed by a real RequestTracker: a
stream's logprobs go out in order even when the sample already holds later ones (outputs are
applied as they arrive, while earlier chunks are still being written); a tool call streams its
name first, then its arguments piece by piece, and ends as tool_calls; a whole body carries
the same calls and one batch-decoded text per logprob entry."""

from __future__ import annotations

import json
from types import SimpleNamespace

from conftest import make_tokenizer  # tests/conftest.py

from parashift.engine.request_tracker import RequestTracker
from parashift.serve.openai_protocol import ChatCompletionRequest, parse
from parashift.serve.responses import ChatFormatter
from parashift.serve.tool_calls import ToolPlan
from parashift.types.outputs import EngineCoreOutput, TokenLogprobs
from parashift.types.sampling_params import SamplingParams

TOKENIZER = make_tokenizer()


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def _formatter(body: dict, tools: ToolPlan | None = None):
    tracker = RequestTracker(TOKENIZER)
    tracker.add_prompt("r", 0, ids("hi"), SamplingParams(logprobs=1, max_tokens=100))
    gen = SimpleNamespace(choices=tracker.samples, num_prompt_tokens=2, num_output_tokens=0,
                          num_cached_tokens=0)
    req = parse(json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode(),
                ChatCompletionRequest)
    return tracker, ChatFormatter("chatcmpl-1", "m", TOKENIZER, gen, req, tools=tools)


def _output(text: str, finish: str | None = None) -> EngineCoreOutput:
    (token,) = ids(text)
    return EngineCoreOutput("r", [token], TokenLogprobs([token, ids("z")[0]], [-0.5, -1.5], 1),
                            finish_reason=finish)


def test_streamed_logprobs_go_out_in_order_though_the_sample_holds_more():
    tracker, formatter = _formatter({"logprobs": True, "top_logprobs": 1})
    deltas = [tracker.apply(_output(ch)) for ch in "abc"]  # applied before any is written
    sent = []
    for delta in deltas:
        (chunk,) = formatter.stream_chunks(delta)
        (entry,) = chunk["choices"][0]["logprobs"]["content"]
        assert entry["top_logprobs"][0]["token"] == "z"
        sent.append(entry["token"])
    assert sent == ["a", "b", "c"] and "".join(sent) == "".join(d.text for d in deltas)


def test_a_named_call_streams_its_name_then_its_arguments():
    plan = ToolPlan("named", name="f")
    tracker, formatter = _formatter({}, tools=plan)
    text = '{"a": 12}'
    pieces = []
    for i, ch in enumerate(text):
        delta = tracker.apply(_output(ch, "stop" if i == len(text) - 1 else None))
        pieces += [c["choices"][0] for c in formatter.stream_chunks(delta)]
    first = pieces[0]["delta"]["tool_calls"][0]
    assert first["function"] == {"name": "f", "arguments": ""} and first["id"].startswith("call_")
    arguments = "".join(p["delta"]["tool_calls"][0]["function"]["arguments"]
                        for p in pieces[1:])
    assert arguments == text and pieces[-1]["finish_reason"] == "tool_calls"
    assert all(p["finish_reason"] is None for p in pieces[:-1])
    whole = formatter.full_response()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": text}

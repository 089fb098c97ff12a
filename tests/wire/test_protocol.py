"""Wire messages round-trip through msgspec (no pickle), and OpenAI bodies validate."""

from __future__ import annotations

import pytest

from parashift.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_messages,
    parse,
    sampling_params,
)
from parashift.types.outputs import EngineCoreOutput, SchedulerStats, TokenLogprobs
from parashift.types.sampling_params import SamplingParams
from parashift.wire import protocol as p


@pytest.mark.parametrize("msg,kind", [
    (p.AddRequest("r1", [1, 2, 3], SamplingParams(n=1, max_tokens=5, stop=["x"], seed=3),
                  2, 0, 12.5), p.ToEngine),
    (p.AbortRequests(["a", "b"]), p.ToEngine),
    (p.UtilityCall(7, "stats", 1), p.ToEngine),
    (p.EngineOutputs(0, [EngineCoreOutput("r1", [5], TokenLogprobs([5, 6], [-0.1, -2.0], 1),
                                          "stop", "x", 16)],
                     SchedulerStats(1, 2, 0.5, 10, 4)), p.Outputs),
    (p.UtilityResult(0, 7, True), p.Outputs),
    (p.RequestFailed(1, "r1", "prompt too long"), p.Outputs),
    (p.EngineDead(1, "boom"), p.Outputs),
    (p.EngineReady(0, 256, 100), p.Control),
    (p.Shutdown(5.0), p.Control),
    (p.Hello(0, 1234), p.Handshake),
    (p.Ready(0, 100, 16, 256, [1000, 1000]), p.Handshake),
    (p.StartupFailed(0, "no memory"), p.Handshake),
])
def test_messages_round_trip(msg, kind):
    data = p.encode(msg)
    assert b"\x80\x04" not in data[:2]  # not a pickle stream
    assert p.decode(data, kind) == msg


def test_decoding_validates_sampling_params():
    import msgspec

    params = SamplingParams()
    params.temperature = -1.0  # bypass construction-time validation
    data = p.encode(p.AddRequest("r", [1], params, None, 0, 0.0))
    with pytest.raises(msgspec.ValidationError, match="temperature must be non-negative"):
        p.decode(data, p.ToEngine)


def completion(**kw) -> CompletionRequest:
    import msgspec

    return parse(msgspec.json.encode({"prompt": "hi", **kw}), CompletionRequest)


def test_completion_defaults_and_limits():
    req = completion()
    params = sampling_params(req, num_prompt_tokens=3, max_model_len=100)
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.top_k == -1
    req = completion(max_tokens=None)
    assert sampling_params(req, 30, 100).max_tokens == 70  # fills the context
    with pytest.raises(OpenAIError, match="30 tokens and max_tokens is 80") as e:
        sampling_params(completion(max_tokens=80), 30, 100)
    assert e.value.status == 400 and e.value.param == "max_tokens"


@pytest.mark.parametrize("field,value,message", [
    ("temperature", -1, "temperature"), ("top_p", 0, "top_p"), ("n", 0, "n must be"),
    ("top_k", -5, "top_k"), ("logprobs", 50, "logprobs"),
])
def test_invalid_sampling_values_are_400(field, value, message):
    with pytest.raises(OpenAIError, match=message) as e:
        sampling_params(completion(**{field: value}), 3, 100)
    assert e.value.status == 400


def test_malformed_and_mistyped_bodies():
    with pytest.raises(OpenAIError, match="not valid JSON"):
        parse(b"{nope", CompletionRequest)
    with pytest.raises(OpenAIError, match=r"\$.max_tokens"):
        parse(b'{"prompt": "x", "max_tokens": "many"}', CompletionRequest)
    with pytest.raises(OpenAIError, match="prompt"):
        parse(b'{"max_tokens": 3}', CompletionRequest)


def test_chat_messages():
    req = parse(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},'
                b' {"type": "text", "text": "b"}]}], "max_completion_tokens": 4, '
                b'"logprobs": true, "top_logprobs": 2}', ChatCompletionRequest)
    assert chat_messages(req) == [{"role": "user", "content": "ab"}]
    params = sampling_params(req, 5, 100)
    assert params.max_tokens == 4 and params.logprobs == 2
    with pytest.raises(OpenAIError, match="must not be empty"):
        chat_messages(parse(b'{"messages": []}', ChatCompletionRequest))
    with pytest.raises(OpenAIError, match="role"):
        chat_messages(parse(b'{"messages": [{"role": "robot", "content": "x"}]}',
                            ChatCompletionRequest))


def test_engine_init_carries_typed_engine_args_and_the_strategy_axes():
    from parashift.config import EngineArgs
    from parashift.strategies.spec import StrategySpec

    spec = StrategySpec.parse("dp2xtp2")
    init = p.EngineInit(EngineArgs(model="/m", max_num_seqs=7, strategy="dp2xtp2"),
                        spec.to_wire(), ["ipc:///a"], ["ipc:///b"])
    back = p.decode(p.encode(init), p.EngineInit)
    assert isinstance(back.engine_args, EngineArgs) and back.engine_args.max_num_seqs == 7
    again = StrategySpec.from_wire(back.strategy)
    assert str(again) == "dp2xtp2"
    assert [type(a) for a in again.axes] == [type(a) for a in spec.axes]

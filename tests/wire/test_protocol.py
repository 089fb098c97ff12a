"""Wire messages round-trip through msgspec (no pickle), and OpenAI bodies validate."""

from __future__ import annotations

import pytest

from parashift.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    parse,
)
from parashift.serve.request_params import chat_messages, sampling_params
from parashift.types.outputs import EngineCoreOutput, SchedulerStats, TokenLogprobs
from parashift.types.sampling_params import SamplingParams
from parashift.wire import engine_calls as calls
from parashift.wire import protocol as p


@pytest.mark.parametrize("msg,kind", [
    (p.AddRequest("r1", [1, 2, 3], SamplingParams(n=1, max_tokens=5, stop=["x"], seed=3),
                  2, 0, 12.5), p.ToEngine),
    (p.AbortRequests(["a", "b"]), p.ToEngine),
    (calls.GetStats(7, 1), p.ToEngine),
    (calls.Sleep(8, 1, 2), p.ToEngine),
    (calls.WakeUp(9, 0), p.ToEngine),
    (calls.IsSleeping(10, 0), p.ToEngine),
    (calls.ResetPrefixCache(11, 1), p.ToEngine),
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


def test_engine_init_carries_the_resolved_config_whole(tiny_llama, tmp_path):
    """Every field of the launcher's config comes back equal (the model's transformers config
    too, the dtype, the strategy's axes); on a node where the launcher's path is missing, the
    engine finds the model the user named, and a different model there is an error naming the
    node."""
    import dataclasses
    import shutil

    import torch

    from parashift.engine.args import EngineArgs, config_for_this_node, create_config
    from parashift.wire.engine_config import config_to_wire

    config = create_config(EngineArgs(tiny_llama, dtype="bfloat16", max_num_seqs=7,
                                      strategy="dp2xtp2", while_asleep="wait"))
    config = config.for_engine(1, "mp", "tcp://127.0.0.1:5")
    init = p.EngineInit(config_to_wire(config), ["ipc:///a"], ["ipc:///b"])
    back = config_for_this_node(p.decode(p.encode(init), p.EngineInit).config)
    assert back.model.dtype == torch.bfloat16 and back.model.path == config.model.path
    assert back.model.hf_config.to_dict() == config.model.hf_config.to_dict()
    assert back.cache == config.cache and back.scheduler == config.scheduler
    assert back.device == config.device
    assert str(back.parallel.strategy) == "dp2xtp2"
    assert [type(a) for a in back.parallel.strategy.axes] == [
        type(a) for a in config.parallel.strategy.axes]
    assert (back.parallel.data_parallel_rank, back.parallel.expert_group_address) == (
        1, "tcp://127.0.0.1:5")

    elsewhere = shutil.copytree(tiny_llama, tmp_path / "copy")
    moved = dataclasses.replace(config, model=dataclasses.replace(
        config.model, path="/gone/on/this/node", tokenizer_path="/gone/on/this/node",
        source=str(elsewhere)))
    found = config_for_this_node(config_to_wire(moved))
    assert found.model.path == found.model.tokenizer_path == str(elsewhere)

    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    text = (other / "config.json").read_text().replace('"num_hidden_layers": 2',
                                                       '"num_hidden_layers": 3')
    (other / "config.json").write_text(text)
    wrong = dataclasses.replace(moved, model=dataclasses.replace(moved.model,
                                                                 source=str(other)))
    with pytest.raises(ValueError, match=r"node .*: the model at .* is not the launcher's.*"
                                         r"num_hidden_layers"):
        config_for_this_node(config_to_wire(wrong))
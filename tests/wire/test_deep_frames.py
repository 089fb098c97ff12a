"""No frame stops a reader by its depth: a value nested 3,000 deep (past the interpreter's
recursion limit) is dropped by `decode_or_drop` like any malformed frame, on every kind of
message our sockets read, wherever it sits: at the top, in any field of any message, in the
fields typed Any (a worker's call and reply), in a config's dict, in a request's schema."""

from __future__ import annotations

import msgspec
import pytest

from parashift.types.sampling_params import SamplingParams
from parashift.types.structured_outputs import StructuredOutputsParams
from parashift.wire import protocol as p
from parashift.wire import worker_protocol as wp

DEPTH = 3000
DEEP_ARRAY = b"\x91" * DEPTH + b"\xc0"  # [[[... nil ...]]]
DEEP_MAP = b"\x81\xa1k" * DEPTH + b"\xc0"  # {"k": {"k": ... nil}}
SENTINEL = "deep-value-goes-here"

KINDS = {"ToEngine": p.ToEngine, "Handshake": p.Handshake, "ToNode": p.ToNode,
         "ToEngineLoad": p.ToEngineLoad, "FromCoordinator": p.FromCoordinator,
         "Outputs": p.Outputs, "Control": p.Control, "EngineInit": p.EngineInit,
         "ApiServerReady": p.ApiServerReady, "ToWorker": wp.ToWorker,
         "FromWorker": wp.FromWorker}


def members(kind) -> list[type]:
    return list(getattr(kind, "__args__", (kind,)))


def with_deep(msg: p._Msg, deep: bytes) -> bytes:
    """`msg` encoded, with the deep value where it holds SENTINEL."""
    frame = p.encode(msg)
    marker = msgspec.msgpack.encode(SENTINEL)
    assert frame.count(marker) == 1
    return frame.replace(marker, deep)


def positional(tag: str, position: int, deep: bytes, filler: bytes) -> bytes:
    """[tag, filler, ..., deep]: the deep value as field `position` (1-based) of `tag`, after
    fields that are nil (b"\\xc0") or 0 (b"\\x00", which many fields take)."""
    return (bytes([0x90 + position + 1]) + msgspec.msgpack.encode(tag)
            + filler * (position - 1) + deep)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_deep_frame_anywhere_is_dropped(name):
    kind = KINDS[name]
    for deep in (DEEP_ARRAY, DEEP_MAP):
        assert p.decode_or_drop(deep, kind, name) is None
        for member in members(kind):
            tag = member.__struct_config__.tag or member.__name__
            for position in range(1, len(member.__struct_fields__) + 1):
                for filler in (b"\xc0", b"\x00"):
                    frame = positional(tag, position, deep, filler)
                    assert p.decode_or_drop(frame, kind, name) is None


def test_the_fields_that_take_any_value_drop_a_deep_one():
    for msg, kind in (
            (wp.WorkerReply(0, SENTINEL), wp.FromWorker),
            (wp.WorkerCall("initialize_cache", [SENTINEL]), wp.ToWorker),
            (p.AddRequest("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(
                regex=SENTINEL)), None, 0, 0.0), p.ToEngine)):
        for deep in (DEEP_ARRAY, DEEP_MAP):
            assert p.decode_or_drop(with_deep(msg, deep), kind, "test") is None
        assert p.decode(p.encode(msg), kind) == msg  # the shallow one is a message


def test_a_config_dict_nested_deep_is_dropped():
    """The head's answer to a Hello carries the model's config as a dict."""
    from parashift.config import CacheConfig, DeviceConfig, SchedulerConfig
    from parashift.strategies.spec import StrategySpec
    from parashift.wire.engine_config import EngineConfigWire, ModelWire, ParallelWire

    config = EngineConfigWire(
        ModelWire("/m", "/m", {"model_type": "llama", "x": SENTINEL}, "float32", 512, "/m", 0,
                  None),
        CacheConfig(kv_cache_memory=32 << 20), SchedulerConfig(),
        ParallelWire(StrategySpec.parse("dp2").to_wire(), 0, "mp", None, True),
        DeviceConfig("cpu", attention_backend="cpu"), None)
    init = p.EngineInit(config, ["ipc://requests"], ["ipc://outputs"])
    for deep in (DEEP_ARRAY, DEEP_MAP):
        assert p.decode_or_drop(with_deep(init, deep), p.EngineInit, "handshake") is None
    assert p.decode(p.encode(init), p.EngineInit) == init


def test_an_engine_calls_answer_is_typed():
    """What engines answer (a reset's bool, a sleep state's or the stats' fields) decodes;
    what no call answers (a string, a list) is dropped."""
    from parashift.types.outputs import SchedulerStats

    stats = p.decode(p.encode(p.UtilityResult(0, 1, SchedulerStats(1, 2, 0.5))), p.Outputs)
    assert stats.result == {"num_waiting": 1, "num_running": 2, "kv_cache_usage": 0.5,
                            "prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0,
                            "num_preemptions": 0, "num_prefix_cache_resets": 0, "kv_tiers": None,
                            "prefill_tokens_left": 0, "output_tokens_left": 0}
    tiers = {"host_hit_blocks": 6, "host_load_seconds": 0.5}  # one record deep, numbers only
    for result in (True, {"level": 1, "released_bytes": 4096}, None, {"kv_tiers": tiers}):
        assert p.decode(p.encode(p.UtilityResult(0, 1, result)), p.Outputs).result == result
    for result in ("text", [1, 2], {"k": [1]}, {"k": {"deeper": {"x": 1}}}):
        assert p.decode_or_drop(p.encode(p.UtilityResult(0, 1, result)), p.Outputs, "t") is None


def test_a_deeply_nested_http_body_is_a_400():
    """The same on the HTTP side: a schema (a dict of any values) nested 3,000 deep."""
    from parashift.serve.openai_protocol import ChatCompletionRequest, OpenAIError, parse

    schema = b'{"a":' * DEPTH + b"1" + b"}" * DEPTH
    body = (b'{"model":"m","messages":[{"role":"user","content":"hi"}],"response_format":'
            b'{"type":"json_schema","json_schema":{"name":"x","schema":' + schema + b"}}}")
    with pytest.raises(OpenAIError, match="nests its values too deeply") as error:
        parse(body, ChatCompletionRequest)
    assert error.value.status == 400

"""A headless node resolves no config of its own: it gets the head's in its NodeInit and checks
it against the engine flags given on its command line and its own devices, memory and model
files, refusing a mismatch with both values named, before any engine starts. The head hears
why (StartupFailed for the node's ranks). A fake head on a real TCP socket."""

from __future__ import annotations

import dataclasses
import threading

import msgspec
import pytest
import zmq

from parashift.config import CacheConfig, DeviceConfig, SchedulerConfig
from parashift.engine.args import EngineArgs, create_config
from parashift.runtime.headless import (
    HeadlessLauncher,
    check_flags,
    check_memory,
    check_node,
)
from parashift.runtime.node import ServeArgs, StartupError
from parashift.strategies.spec import StrategySpec
from parashift.wire import protocol as p
from parashift.wire.engine_config import (
    EngineConfigWire,
    ModelWire,
    ParallelWire,
    config_to_wire,
)

GIB = 1 << 30


def head_config(strategy: str = "dp4", dtype: str = "bfloat16", **scheduler) -> EngineConfigWire:
    """A config as a head resolves it, without a model behind it (flags are checked first)."""
    return EngineConfigWire(
        ModelWire("/models/llama", "/models/llama", {"model_type": "llama"}, dtype, 512,
                  "/models/llama", 0, None),
        CacheConfig(kv_cache_memory=32 << 20), SchedulerConfig(max_num_seqs=128, **scheduler),
        ParallelWire(StrategySpec.parse(strategy).to_wire(), 2, "mp", None, True),
        DeviceConfig("cpu", attention_backend="cpu"), None)


@pytest.mark.parametrize("flags, message", [
    ({"dtype": "float16"}, "the head resolved dtype bfloat16, this node's --dtype is float16"),
    ({"data_parallel_size": 2},
     "the head resolved the strategy dp4, this node's flags say dp2"),
    ({"strategy": "dp4xtp2"}, "the head resolved the strategy dp4, this node's flags say "
                              "dp4xtp2"),
    ({"max_num_seqs": 8}, "the head resolved max-num-seqs 128, this node's --max-num-seqs is 8"),
    ({"kv_cache_memory": 64 << 20},
     f"the head resolved kv-cache-memory {32 << 20}, this node's --kv-cache-memory is "
     f"{64 << 20}"),
    ({"device": "cuda"}, "the head resolved device cpu, this node's --device is cuda"),
    ({"disable_shm_all_reduce": True}, "the head resolved disable-shm-all-reduce False"),
    ({"gemm_paths": "linear"}, "the head resolved gemm-paths linear,onednn,own-bf16, this "
                               "node's --gemm-paths is linear"),
])
def test_a_flag_given_here_that_the_head_resolved_otherwise_is_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        check_flags(EngineArgs(**flags), head_config())


@pytest.mark.parametrize("flags", [
    {},  # nothing typed here: the head's config, whatever it is
    {"dtype": "bf16"},  # an alias of the head's dtype
    {"dtype": "auto", "strategy": "auto"},  # the head's to choose
    {"data_parallel_size": 4, "max_model_len": 512, "kv_cache_memory": 32 << 20},
    {"strategy": "dp4", "attention_backend": "cpu", "device": "cpu"},
])
def test_flags_that_agree_with_the_head_pass(flags):
    check_flags(EngineArgs(**flags), head_config())


def test_async_scheduling_is_compared_as_the_head_resolved_it():
    """--async-scheduling on both: a pipeline's head resolves it off, as this node would."""
    check_flags(EngineArgs(async_scheduling=True), head_config("dp2xpp2"))
    with pytest.raises(ValueError, match="async-scheduling True, this node's "
                                         "--async-scheduling is False"):
        check_flags(EngineArgs(async_scheduling=False),
                    head_config(async_scheduling=True))


def test_the_kv_budget_of_this_nodes_workers_must_fit_its_memory(tiny_llama):
    config = create_config(EngineArgs(tiny_llama, dtype="float32", device="cpu",
                                      kv_cache_memory=2 * GIB, strategy="dp4xtp2"))
    check_memory(config, 2, memory=8 * GIB)
    with pytest.raises(ValueError, match="a KV cache of 2.00 GiB per worker .*: this node's "
                                         "4 workers need 8.00 GiB, it has 6.00 GiB of memory"):
        check_memory(config, 2, memory=6 * GIB)


def node_args(**engine) -> ServeArgs:
    return ServeArgs(EngineArgs(**engine), headless=True, data_parallel_start_rank=2,
                     data_parallel_size_local=2, insecure_cluster=True)


def test_the_model_given_here_must_be_the_heads(tiny_llama, tiny_model_factory):
    wire = config_to_wire(create_config(EngineArgs(tiny_llama, dtype="float32", device="cpu",
                                                   strategy="dp4")).for_engine(2, "mp", None))
    mesh = check_node(node_args(model=tiny_llama, dtype="float32"), wire, [2, 3])
    assert [w.process_name for w in mesh.ranks] == ["parashift-engine-dp2",
                                                   "parashift-engine-dp3"]
    check_node(node_args(), wire, [2, 3])  # no MODEL here: the head's
    other = tiny_model_factory("qwen2")
    with pytest.raises(ValueError, match=f"the head resolved the model {tiny_llama} .*, this "
                                         f"node's MODEL is {other}"):
        check_node(node_args(model=other), wire, [2, 3])
    with pytest.raises(ValueError, match="--data-parallel-size-local 2 do not fit in "
                                         "--data-parallel-size 3"):
        three = msgspec.structs.replace(wire, parallel=msgspec.structs.replace(
            wire.parallel, strategy=StrategySpec.parse("dp3").to_wire()))
        check_node(node_args(), three, [2, 3])


@pytest.fixture
def fake_head(monkeypatch):
    """A ROUTER where the head's handshake would be (no cluster secret: --insecure-cluster)."""
    monkeypatch.delenv("PARASHIFT_CLUSTER_SECRET", raising=False)
    ctx = zmq.Context()
    head = ctx.socket(zmq.ROUTER)
    head.setsockopt(zmq.LINGER, 0)
    port = head.bind_to_random_port("tcp://127.0.0.1")
    yield head, port
    head.close()
    ctx.term()


def test_a_node_refuses_a_head_config_that_differs_from_its_flags(fake_head):
    head, port = fake_head
    args = node_args(dtype="float16", data_parallel_size=4)
    args = dataclasses.replace(args, data_parallel_rpc_port=port, startup_timeout=30)
    node = HeadlessLauncher(args)
    assert node.local_ranks == [2, 3]
    try:
        errors: list[StartupError] = []

        def start() -> None:
            try:
                node.start()
            except StartupError as e:
                errors.append(e)

        thread = threading.Thread(target=start)
        thread.start()
        assert head.poll(30_000)
        identity, frame = head.recv_multipart()
        assert p.decode(frame, p.Handshake) == p.NodeHello(2, 2)
        head.send_multipart([identity, p.encode(p.NodeInit("tcp://127.0.0.1:1", head_config()))])
        thread.join(30)
        assert not thread.is_alive() and len(errors) == 1
        assert "the head resolved dtype bfloat16, this node's --dtype is float16" in str(errors[0])
        assert node.engines is None  # refused before any engine started
        failures = []
        for _ in range(2):  # the head hears why, for each of the node's ranks
            assert head.poll(10_000)
            failures.append(p.decode(head.recv_multipart()[1], p.Handshake))
        assert [f.rank for f in failures] == [2, 3]
        assert all(isinstance(f, p.StartupFailed) and "--dtype is float16" in f.error
                   and f.error.startswith("node ") for f in failures)
    finally:
        node.shutdown()


def test_a_node_needs_its_size_before_the_handshake():
    with pytest.raises(ValueError, match="needs --data-parallel-size-local"):
        HeadlessLauncher(ServeArgs(EngineArgs(), headless=True, data_parallel_start_rank=2,
                                   insecure_cluster=True))

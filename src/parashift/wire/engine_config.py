"""The resolved engine config as the launcher sends it to every engine (EngineInit), whole and
typed: the engines never resolve `EngineArgs` again. The model's transformers config travels
as its dict, the dtype as its name, the strategy as its axes. What an engine finds on its own
host is checked against it (engine/args.py `config_for_this_node`; a headless node's
launcher first, runtime/headless.py), never put in its place."""

from __future__ import annotations

from typing import Any

import msgspec

from parashift.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from parashift.strategies.spec import StrategyAxis, StrategySpec


class _Part(msgspec.Struct, array_like=True, gc=False, forbid_unknown_fields=True):
    pass


class ModelWire(_Part):
    source: str | None  # the user's model argument: a node without `path` finds it from this
    path: str  # where the launcher found the weights (its node)
    # transformers' own dict (nested: rope_scaling and the like), from the head alone; its depth
    # is bounded by the interpreter's recursion limit (protocol.decode_or_drop drops past it)
    hf_config: dict[str, Any]
    dtype: str  # torch dtype name: "bfloat16"
    max_model_len: int
    tokenizer_path: str
    seed: int
    quantization: str | None


class ParallelWire(_Part):
    strategy: list[StrategyAxis]
    data_parallel_rank: int
    distributed_executor_backend: str
    expert_group_address: str | None
    shm_all_reduce: bool


class EngineConfigWire(_Part):
    model: ModelWire
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelWire
    device: DeviceConfig
    worker_extension_cls: str | None


def config_to_wire(config: EngineConfig) -> EngineConfigWire:
    m, par = config.model, config.parallel
    return EngineConfigWire(
        ModelWire(m.source, m.path, m.hf_config.to_dict(), str(m.dtype).removeprefix("torch."),
                  m.max_model_len, m.tokenizer_path, m.seed, m.quantization),
        config.cache, config.scheduler,
        ParallelWire(par.strategy.to_wire(), par.data_parallel_rank,
                     par.distributed_executor_backend, par.expert_group_address,
                     par.shm_all_reduce),
        config.device, config.worker_extension_cls)


def config_from_wire(wire: EngineConfigWire, model_path: str | None = None) -> EngineConfig:
    """The config the launcher resolved; `model_path`: where this node holds the weights
    (engine/args.py `config_for_this_node` finds and checks it), the tokenizer too when it is
    the model's own."""
    import torch
    from transformers import AutoConfig

    m, par = wire.model, wire.parallel
    fields = dict(m.hf_config)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = model_path or m.path
    tokenizer = path if m.tokenizer_path == m.path else m.tokenizer_path
    model = ModelConfig(path, hf_config, getattr(torch, m.dtype), m.max_model_len, tokenizer,
                        m.seed, m.quantization, m.source)
    parallel = ParallelConfig(StrategySpec.from_wire(par.strategy), par.data_parallel_rank,
                              par.distributed_executor_backend, par.expert_group_address,
                              par.shm_all_reduce)
    return EngineConfig(model, wire.cache, wire.scheduler, parallel, wire.device,
                        wire.worker_extension_cls)

"""Architecture name (config.json `architectures`) -> model class, imported lazily."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Qwen2ForCausalLM": "qwen2:Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM": "qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM": "qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "qwen3_moe:Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def architecture_of(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError("config.json names no architecture ('architectures' is empty)")
    return archs[0]


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    module, cls = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(f"parashift.models.{module}"), cls)

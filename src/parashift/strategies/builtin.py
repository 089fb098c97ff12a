"""The built-in axes. Pipeline and expert parallel validate already; they run once their
issues land (until then they say so instead of running something else)."""

from __future__ import annotations

from typing import Any

from parashift.strategies.base import Strategy


class DataParallel(Strategy):
    """Independent engine replicas, each with its own scheduler and KV cache."""

    name, axis = "dp", "data"


class TensorParallel(Strategy):
    """Each engine's model split over tp worker processes (heads, MLP columns, vocabulary)."""

    name, axis = "tp", "tensor"

    def check_model(self, hf_config: Any) -> list[str]:
        tp, errors = self.size, []
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        if heads % tp:
            errors.append(f"tp{tp} needs num_attention_heads ({heads}) divisible by {tp}")
        if kv_heads % tp and tp % kv_heads:
            errors.append(f"tp{tp} needs num_key_value_heads ({kv_heads}) and {tp} to divide "
                          "one another")
        inter = getattr(hf_config, "intermediate_size", None)
        if inter is not None and inter % tp:
            errors.append(f"tp{tp} needs intermediate_size ({inter}) divisible by {tp}")
        return errors


class PipelineParallel(Strategy):
    name, axis, available = "pp", "pipeline", False

    def check_model(self, hf_config: Any) -> list[str]:
        errors = []
        layers = hf_config.num_hidden_layers
        if self.size > layers:
            errors.append(f"pp{self.size} needs at least {self.size} layers, the model has "
                          f"{layers}")
        return errors


class ExpertParallel(Strategy):
    name, axis, is_flag, available = "ep", "expert", True, False

    def check_model(self, hf_config: Any) -> list[str]:
        experts = getattr(hf_config, "num_local_experts", None) or getattr(
            hf_config, "num_experts", None)
        if self.size and not experts:
            return ["ep: the model has no experts (expert parallel needs an MoE model)"]
        return []

"""Qwen3-MoE: Qwen3 attention (q/k norms), sparse blocks without a shared expert
(models/moe_model.py)."""

from __future__ import annotations

from parashift.models.moe_model import QwenMoEModel
from parashift.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(QwenMoEModel, Qwen3ForCausalLM):
    pass

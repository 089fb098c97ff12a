"""Qwen2-MoE: Qwen2 attention (q/k/v bias), sparse blocks with a gated shared expert, and
dense layers where `mlp_only_layers` / `decoder_sparse_step` say so (models/moe_model.py)."""

from __future__ import annotations

from parashift.models.moe_model import QwenMoEModel
from parashift.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(QwenMoEModel, Qwen2ForCausalLM):
    pass

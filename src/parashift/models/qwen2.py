"""Qwen2 / Qwen2.5: Llama with a bias on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from parashift.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    attn_flags = {"qkv_bias": True, "o_bias": False, "qk_norm": False}

    @staticmethod
    def _sliding_window(cfg: Any, max_position: int) -> int | None:
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("Qwen2 checkpoints with use_sliding_window=true are not supported")
        return None

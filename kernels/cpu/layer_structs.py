"""The fused decoder layer's arguments as ctypes structs (layer.cpp's ParashiftLayerWeights and
ParashiftLayerStep): the field order is the C structs' own."""

from __future__ import annotations

from ctypes import Structure, c_float, c_int, c_int64, c_void_p

import torch


def ptr_or_null(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class LayerWeights(Structure):
    """One Llama layer's packed weights and KV cache (layer.cpp's ParashiftLayerWeights)."""

    _fields_ = [(name, c_void_p) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "gate_up_bias", "down",
        "key_cache", "value_cache", "next_qkv", "qkv_scale", "o_scale", "gate_up_scale",
        "down_scale")]

    @classmethod
    def of(cls, *tensors: torch.Tensor | None) -> LayerWeights:
        """The fields' tensors in order (None: a null pointer; the fields from next_qkv on, the
        following layer's packed QKV weight and int8 weights' scales, may be left out)."""
        return cls(*(ptr_or_null(t) for t in tensors))


class LayerStep(Structure):
    """What every layer of a step shares (layer.cpp's ParashiftLayerStep)."""

    _fields_ = [
        *((name, c_int64) for name in ("tokens", "hidden", "heads", "kv_heads", "head_dim",
                                       "intermediate")),
        ("eps", c_float), ("scale", c_float), ("cos", c_void_p), ("sin", c_void_p),
        ("slot_mapping", c_void_p), ("block_tables", c_void_p), ("table_width", c_int64),
        ("seq_lens", c_void_p), ("block_size", c_int64), ("window", c_int64),
        *((name, c_void_p) for name in ("normed", "qkv", "attn", "o", "gate_up", "act")),
        ("num_threads", c_int),
        # prefill chunks for the tiled prefill kernel (prefills 0: every token a decode query)
        ("decodes", c_int64), ("prefills", c_int64), ("chunk_tables", c_void_p),
        ("chunk_table_width", c_int64), ("query_starts", c_void_p), ("chunk_seq_lens", c_void_p),
        ("decode_order", c_int)]  # --deterministic: the tiled kernel off AMX tiles, as decode

"""From a user's model argument to a loaded, weight-filled model."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig

from parashift.distributed.parallel_context import ParallelContext
from parashift.layers.attention.backend import AttentionBackend
from parashift.layers.weights import iterate_weights
from parashift.models.gguf import converted_gguf_folder, embedded_default_gguf
from parashift.models.registry import architecture_of, get_model_class

logger = logging.getLogger(__name__)


def resolve_model_path(model: str | None) -> str:
    """A Hugging Face folder for `model`: None means the embedded SmolLM2; a .gguf file is
    converted once and cached."""
    if model is None:
        return converted_gguf_folder(embedded_default_gguf())
    if not os.path.exists(model):
        raise ValueError(f"MODEL {model!r} does not exist (parashift never downloads "
                         "weights: give a local Hugging Face folder or a .gguf file)")
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"MODEL {model!r} is not a .gguf file")
        try:
            return converted_gguf_folder(model)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"MODEL {model!r} cannot be read: {e}") from None
    if not os.path.exists(os.path.join(model, "config.json")):
        raise ValueError(f"MODEL folder {model!r} has no config.json")
    return model


def load_hf_config(path: str) -> Any:
    try:
        return AutoConfig.from_pretrained(path)  # nosec B615
    except (ValueError, OSError) as e:
        raise ValueError(f"MODEL {path!r}: its config.json cannot be read ({e})") from None


def load_model(path: str, hf_config: Any, dtype: torch.dtype, device: torch.device,
               backend: AttentionBackend, max_position: int, parallel: ParallelContext
               ) -> nn.Module:
    """The model for this rank's shard plan (`parallel.shard`), reading only its slices (its
    GEMM weights are prepared for this CPU afterwards: layers/gemm.py)."""
    model_cls = get_model_class(architecture_of(hf_config))
    start = time.perf_counter()
    with torch.device(device):
        model = model_cls(hf_config, dtype, backend, max_position, parallel)
    try:
        model.load_weights(iterate_weights(path))
    except ValueError as e:  # a corrupt or mismatched checkpoint
        raise ValueError(f"MODEL {path!r}: {e}") from None
    model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("loaded %s (%.1f M parameters, %s) in %.1f s", architecture_of(hf_config),
                num_params / 1e6, str(dtype).removeprefix("torch."), time.perf_counter() - start)
    return model


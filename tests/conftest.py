"""Shared fixtures: tiny random-weight models saved as real Hugging Face folders, a byte-level
tokenizer made in code, and the embedded SmolLM2 (converted once per cache directory)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import parashift  # noqa: F401  (before transformers: keeps the checkout's kernels/ off sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The studies in scripts/ (layouts, kernels, backends, soak) import each other by module name,
# as they do when run as `python scripts/NAME.py`.
SCRIPTS = os.path.join(ROOT, "scripts")
sys.path.insert(0, SCRIPTS)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_VOCAB = 320  # 256 bytes + specials, padded


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


def tiny_config(arch: str, tie: bool = False, **overrides):
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = dict(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=tie, bos_token_id=256, eos_token_id=257,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
                "rope_theta": 500000.0}
        return LlamaConfig(**common, rope_parameters=rope)
    if arch == "mistral":
        return MistralConfig(**{**common, "sliding_window": 48})
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 32})
    # MoE: 5 experts, so that no layout of 2 or 4 ranks splits them evenly.
    if arch == "mixtral":
        return MixtralConfig(**{"num_local_experts": 5, "num_experts_per_tok": 2, **common})
    moe = {"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **common}
    if arch == "qwen2_moe":  # a gated shared expert, the second layer dense
        return Qwen2MoeConfig(**{"shared_expert_intermediate_size": 48, "mlp_only_layers": [1],
                                 "norm_topk_prob": False, **moe})
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**{"head_dim": 32, "norm_topk_prob": True, **moe})
    raise ValueError(arch)


def save_tiny_model(folder: str, arch: str, tie: bool = False, seed: int = 0, **overrides) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, tie, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is small; widen it so that logits are far from uniform and greedy is stable.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    made: dict[tuple, str] = {}

    def make(arch: str = "llama", tie: bool = False, **overrides) -> str:
        key = (arch, tie, tuple(sorted(overrides.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}-{'tied' if tie else 'untied'}")
            made[key] = save_tiny_model(str(folder), arch, tie, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from parashift.models.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tiny_split_by_3(tiny_model_factory) -> str:
    """A tiny model tp3 can split: 6 heads, 3 kv heads, a vocabulary (320) padded to 107 rows
    a rank; Qwen3 for its q/k norms."""
    return tiny_model_factory("qwen3", num_attention_heads=6, num_key_value_heads=3,
                              intermediate_size=192)


def cli_in_process(*args: str):
    """`parashift ARGS` through the same typer app in this process: for flags refused before
    anything runs (a subprocess spends ~6 s on imports first). exit_code, stdout, stderr."""
    from typer.testing import CliRunner

    from parashift.cli import app

    return CliRunner().invoke(app, list(args))


# study name -> (its script in scripts/, its command function)
STUDIES = {"dp-scaling": ("bench_dp_scaling", "dp_scaling"), "tp": ("bench_tp", "tp"),
           "pipeline": ("bench_pipeline", "pipeline"), "moe": ("bench_moe", "moe"),
           "serving-vs-offline": ("bench_serving_vs_offline", "serving_vs_offline"),
           "backends": ("bench_backends", "backends"), "soak": ("soak", "soak"),
           "cpu-kernels": ("bench_cpu_kernels", "cpu_kernels"),
           "kernels": ("bench_kernels", "kernels"), "routing": ("bench_routing", "routing"),
           "quantization": ("bench_quantization", "quantization"),
           "structured": ("bench_structured", "structured")}


def study_in_process(name: str, *args: str, env: dict[str, str] | None = None):
    """`python scripts/STUDY.py ARGS` through its typer command in this process (flags refused
    before anything runs need no interpreter start)."""
    import importlib

    import typer
    from typer.testing import CliRunner

    module, function = STUDIES[name]
    app = typer.Typer()
    app.command()(getattr(importlib.import_module(module), function))
    return CliRunner().invoke(app, list(args), env=env)


def plan_json(model: str, strategy: str, *flags: str) -> dict:
    """`parashift plan MODEL --strategy S --device cpu --json FLAGS`."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "parashift.cli", "plan", model, "--strategy",
                           strategy, "--device", "cpu", "--json", *flags],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def predicted(doc: dict) -> tuple[int, int]:
    """The plan's KV blocks and weight bytes per worker (one pipeline stage)."""
    (stage,) = doc["memory_per_device"]
    return doc["kv_capacity"]["blocks"], stage["weights"]


def install_strategy_plugin(folder, module: str, source: str, token: str, cls: str) -> str:
    """A plugin package laid out as pip installs one: `module`.py plus a dist-info whose
    entry point registers `module:cls` as the strategy axis `token`. Returns the folder, to
    put on sys.path / PYTHONPATH."""
    (folder / f"{module}.py").write_text(source)
    dist = folder / f"{module}-0.1.dist-info"
    dist.mkdir()
    name = module.replace("_", "-")
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[parashift.strategies]\n{token} = {module}:{cls}\n")
    return str(folder)

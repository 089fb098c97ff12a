"""Random-weight models saved as Hugging Face folders, for benchmarks that need a model big
enough for compute and weight streaming to dominate: a Llama (`python scripts/bench_tp.py`) and
a Mixtral-shaped MoE (`python scripts/bench_moe.py`). Token ids are all that matter: SmolLM2's
tokenizer (49k entries) detokenizes any id below its size."""

from __future__ import annotations

import os
import tempfile


def random_llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                 vocab: int, root: str | None = None, tokenizer: str | None = None) -> str:
    """The folder of that model under `root` (the temp dir), made once per shape;
    `tokenizer`: a folder to take the tokenizer from (default: the embedded SmolLM2's)."""
    from transformers import LlamaConfig

    name = f"parashift-bench-llama-h{hidden}-i{intermediate}-l{layers}-a{heads}-kv{kv_heads}" \
           f"-v{vocab}"
    return _saved(name, root, vocab, tokenizer, lambda: LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=False))


def random_mixtral(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                   experts: int, top_k: int, vocab: int, root: str | None = None) -> str:
    """A Mixtral-shaped MoE: `experts` routed experts of `intermediate` columns, top-k."""
    from transformers import MixtralConfig

    name = f"parashift-bench-mixtral-h{hidden}-i{intermediate}-l{layers}-a{heads}-kv{kv_heads}" \
           f"-e{experts}-k{top_k}-v{vocab}"
    return _saved(name, root, vocab, None, lambda: MixtralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=2048,
        tie_word_embeddings=False))


def _saved(name: str, root: str | None, vocab: int, tokenizer_dir: str | None,
           make_config) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parashift.models.loader import resolve_model_path

    folder = os.path.join(root or tempfile.gettempdir(), name)
    if os.path.exists(os.path.join(folder, "tokenizer_config.json")):  # written last
        return folder
    tokenizer_dir = tokenizer_dir or resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)  # nosec B615
    if vocab > len(tokenizer):
        raise ValueError(f"--vocab {vocab} is above the {len(tokenizer)} entries of the "
                         "tokenizer it is saved with")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(), dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"random {name}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B "
          f"parameters -> {folder}", flush=True)
    return folder

"""Well-known models as config numbers only (from their published config.json files), so
that `parashift plan Llama-3.1-70B` needs no download."""

from __future__ import annotations

from parashift.plan.shape import ModelShape

_LLAMA3 = dict(vocab_size=128256, head_dim=128, num_kv_heads=8, max_position_embeddings=131072)
_QWEN3 = dict(vocab_size=151936, head_dim=128, max_position_embeddings=40960)

PRESETS: dict[str, ModelShape] = {m.name: m for m in [
    ModelShape("Llama-3.1-8B", hidden_size=4096, num_layers=32, num_heads=32,
               intermediate_size=14336, **_LLAMA3),
    ModelShape("Llama-3.1-70B", hidden_size=8192, num_layers=80, num_heads=64,
               intermediate_size=28672, **_LLAMA3),
    ModelShape("Llama-3.1-405B", hidden_size=16384, num_layers=126, num_heads=128,
               intermediate_size=53248, **_LLAMA3),
    ModelShape("Qwen3-8B", hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8,
               intermediate_size=12288, **_QWEN3),
    ModelShape("Qwen3-32B", hidden_size=5120, num_layers=64, num_heads=64, num_kv_heads=8,
               intermediate_size=25600, **_QWEN3),
    ModelShape("Qwen3-30B-A3B", hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
               intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
               moe_intermediate_size=768, **_QWEN3),
    ModelShape("Qwen3-235B-A22B", hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
               intermediate_size=12288, num_experts=128, num_experts_per_tok=8,
               moe_intermediate_size=1536, **_QWEN3),
    ModelShape("Qwen2-57B-A14B", hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
               head_dim=128, intermediate_size=18944, vocab_size=151936,
               max_position_embeddings=32768, num_experts=64, num_experts_per_tok=8,
               moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
               qkv_bias=True),
    ModelShape("Mixtral-8x7B", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
               head_dim=128, intermediate_size=14336, vocab_size=32000,
               max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=14336),
    ModelShape("DeepSeek-V3", hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128,
               head_dim=192, intermediate_size=18432, vocab_size=129280,
               max_position_embeddings=163840, num_experts=256, num_experts_per_tok=8,
               moe_intermediate_size=2048, num_shared_experts=1, first_dense_layers=3,
               kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
               v_head_dim=128),
]}


def find_preset(name: str) -> ModelShape | None:
    by_lower = {k.lower(): v for k, v in PRESETS.items()}
    return by_lower.get(name.lower())

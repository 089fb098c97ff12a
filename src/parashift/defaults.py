"""Engine defaults that `parashift plan` must reproduce exactly; kept free of heavy imports
so that the planner answers without loading torch."""

from __future__ import annotations

DEFAULT_CPU_KV_CACHE_MEMORY = 2 << 30  # KV budget of a CPU worker without --kv-cache-memory
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 128


def default_max_num_batched_tokens(max_num_seqs: int) -> int:
    """The per-step token budget without --max-num-batched-tokens."""
    return max(2048, max_num_seqs)

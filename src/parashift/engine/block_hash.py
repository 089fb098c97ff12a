"""The chained hash of a full KV block: hash(parent block's hash, the block's token ids), the
first block's also over the request's `cache_salt`.

Stable across processes, machines and Python versions (BLAKE2b over the ids as little-endian
int32s, no PYTHONHASHSEED), so that an API server's router computes exactly the hashes the
engine's prefix cache uses. Torch-free: the router imports it.

A salt enters the first block only, and every later block chains on it: requests with
different salts (tenants) never share a block, so no tenant learns from `cached_tokens` or
timing which prompts another sent (vLLM's cache_salt)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_PARENT = struct.Struct("<q")
_SALT_LEN = struct.Struct("<I")


def hash_block(parent: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """`salt` counts for a first block only (parent None); its length goes first, so that no
    salt and its tokens read as another salt with other tokens."""
    h = hashlib.blake2b(_PARENT.pack(-1 if parent is None else parent), digest_size=8)
    if parent is None and salt is not None:
        salted = salt.encode()
        h.update(_SALT_LEN.pack(len(salted)) + salted)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(h.digest(), "little") >> 1  # fits an int64


def block_hashes(token_ids: Sequence[int], block_size: int, known: Sequence[int] = (),
                 salt: str | None = None) -> list[int]:
    """The hashes of every full block of token_ids; `known`: those of its first blocks,
    already computed (they are kept, the rest appended); `salt`: the request's cache_salt."""
    hashes = list(known)
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        hashes.append(hash_block(hashes[-1] if hashes else None,
                                 token_ids[i * block_size : (i + 1) * block_size], salt))
    return hashes

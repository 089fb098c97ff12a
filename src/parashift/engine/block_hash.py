"""The chained hash of a full KV block: hash(parent block's hash, the block's token ids).

Stable across processes, machines and Python versions (BLAKE2b over the ids as little-endian
int32s, no PYTHONHASHSEED), so that an API server's router computes exactly the hashes the
engine's prefix cache uses. Torch-free: the router imports it."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_PARENT = struct.Struct("<q")


def hash_block(parent: int | None, token_ids: Sequence[int]) -> int:
    h = hashlib.blake2b(_PARENT.pack(-1 if parent is None else parent), digest_size=8)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return int.from_bytes(h.digest(), "little") >> 1  # fits an int64


def block_hashes(token_ids: Sequence[int], block_size: int,
                 known: Sequence[int] = ()) -> list[int]:
    """The hashes of every full block of token_ids; `known`: those of its first blocks,
    already computed (they are kept, the rest appended)."""
    hashes = list(known)
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        hashes.append(hash_block(hashes[-1] if hashes else None,
                                 token_ids[i * block_size : (i + 1) * block_size]))
    return hashes

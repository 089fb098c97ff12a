"""What a KV block's bytes depend on besides its tokens: the tier identity. A block's key in
the host and disk tiers is a digest of (the identity, the block's chained hash, which covers
its tokens, its prefix and the request's cache_salt), so no tier ever hands a block to an
engine whose model files, dtype, block size or shard layout differ."""

from __future__ import annotations

import hashlib
import os
import struct

# Bump when the bytes of a block change meaning: the order of layers, K/V or heads in a slot.
KV_LAYOUT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".json", ".model")


def _files(path: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of the model's files: a changed checkpoint is another model."""
    if os.path.isfile(path):
        st = os.stat(path)
        return [(os.path.basename(path), st.st_size, st.st_mtime_ns)]
    out = []
    for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
        if name.endswith(_WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(path, name))
            out.append((name, st.st_size, st.st_mtime_ns))
    return out


def tier_identity(model_path: str, dtype: str, block_size: int, layout: str,
                  worker_block_bytes: int, num_workers: int) -> bytes:
    """32 bytes. `layout`: the engine's shard layout (its strategy's tp and pp sizes);
    `worker_block_bytes`: one block's bytes on one worker."""
    h = hashlib.blake2b(digest_size=32, person=b"parashift-kv")
    h.update(struct.pack("<IIQI", KV_LAYOUT_VERSION, block_size, worker_block_bytes,
                         num_workers))
    for part in (os.path.realpath(model_path), dtype, layout):
        h.update(part.encode() + b"\0")
    for name, size, mtime in _files(model_path):
        h.update(name.encode() + struct.pack("<QQ", size, mtime))
    return h.digest()


def tier_key(identity: bytes, block_hash: int) -> int:
    digest = hashlib.blake2b(identity + struct.pack("<q", block_hash), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: an int64 in the arena's index

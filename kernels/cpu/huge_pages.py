"""Zeroed CPU tensors in transparent huge pages (2 MiB), for the memory the CPU kernels stream
every step: the packed GEMM weights (not the KV cache: see Worker._allocate_cache).

With 4 KiB pages a decode step's ~240 MB of weights cross 60 thousand pages: a TLB miss each,
and the hardware prefetchers stop at every page's end (the GEMMs' gain: docs/BENCHMARKS.md,
CPU kernels). torch's allocator gives
64-byte-aligned memory that the kernel backs with small pages unless THP is "always"; here the
memory is a private anonymous mapping, aligned to 2 MiB and advised MADV_HUGEPAGE (THP's
"madvise" mode is the common default).

Small tensors share 32 MiB chunks, handed out in order and never reused (so always zero); a
chunk is unmapped once the last tensor in it is gone. Without MADV_HUGEPAGE (not Linux), plain
torch.zeros."""

from __future__ import annotations

import math
import mmap
import threading

import torch

HUGE_PAGE = 2 << 20
CHUNK = 32 << 20
ALIGN = 64  # a cache line: every tensor starts on one

_lock = threading.Lock()
_chunk: torch.Tensor | None = None  # bytes of the current chunk, from _used on free
_used = 0


def available() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE")


def _mapping(nbytes: int) -> torch.Tensor:
    """nbytes (a multiple of HUGE_PAGE) of zeros, starting on a huge page, advised, and written
    once: resident from the start, as torch.zeros would be (no step pays for faulting it in)."""
    # private: a shared anonymous mapping is shmem, which THP leaves alone by default
    mapped = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapped, dtype=torch.uint8)  # keeps `mapped` alive
    start = -whole.data_ptr() % HUGE_PAGE
    mapped.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start : start + nbytes].zero_()


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous tensor whose pages are huge where the kernel grants them."""
    if not available():
        return torch.zeros(shape, dtype=dtype)
    global _chunk, _used
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    size = -(-max(nbytes, 1) // ALIGN) * ALIGN
    if size > CHUNK // 2:  # its own mapping
        raw = _mapping(-(-size // HUGE_PAGE) * HUGE_PAGE)[:nbytes]
    else:
        with _lock:
            if _chunk is None or _used + size > CHUNK:
                _chunk, _used = _mapping(CHUNK), 0
            raw = _chunk[_used : _used + nbytes]
            _used += size
    return raw.view(dtype).view(shape)

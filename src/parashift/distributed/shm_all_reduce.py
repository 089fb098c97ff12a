"""All-reduce through shared memory for the tensor-parallel ranks of one CPU node.

gloo's all-reduce goes through TCP loopback and costs ~1.3 ms even for a decode step's few
kilobytes, and a layer makes two of them (docs/BENCHMARKS.md). Here every rank copies its
tensor into its own slot of one shared mapping, the ranks meet at a flag barrier, and each sums
all slots in rank order, so every rank gets the same bits. Tensors larger than a slot (long
prefills, where the GEMMs dwarf the collective) still go through gloo.

The flags rely on x86's store order (a slot's bytes are visible before the flag written after
them), so other CPUs keep gloo."""

from __future__ import annotations

import logging
import os
import platform
import secrets
import time

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SLOT_BYTES = 4 << 20  # a decode step's hidden states at any batch the CPU serves, and more
_LINE = 64  # one cache line per flag, so that ranks never write the same line
_SPIN_S = 1e-3  # spin this long (yielding the core) before polling with short sleeps
_TIMEOUT_S = 600.0  # as the gloo group's: a peer this late is gone


def _create(path: str, size: int) -> None:
    """A zero-filled file (every flag starts at call 0) whose pages are reserved now: a full
    /dev/shm fails here rather than with SIGBUS at the first write."""
    # O_EXCL | O_NOFOLLOW: never a file (or link) another user planted under the name.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def shm_path(tag: str) -> str:
    """Where the mapping's file lives while the ranks open it: memory-backed where possible,
    under a name no other user can guess (and so plant first)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"  # nosec B108
    return os.path.join(folder, f"parashift-{tag}-{secrets.token_hex(16)}-all-reduce")


class ShmAllReduce:
    def __init__(self, buffer: torch.Tensor, rank: int, world_size: int, slot_bytes: int):
        self.rank = rank
        self.world_size = world_size
        self.slot_bytes = slot_bytes
        header = 2 * world_size * _LINE
        flags = buffer[:header].numpy().view(np.int64).reshape(2, world_size, _LINE // 8)
        self.arrived = flags[0, :, 0]  # rank r has written its slot for call number n
        self.summed = flags[1, :, 0]  # rank r has read every slot for call number n
        self.slots = buffer[header:].view(world_size, slot_bytes)
        self.calls = 0

    @classmethod
    def open(cls, path: str, rank: int, world_size: int, group: dist.ProcessGroup,
             slot_bytes: int = SLOT_BYTES) -> ShmAllReduce | None:
        """Collective over `group`: rank 0 creates the file, every rank maps it, then rank 0
        removes the name. The mapping outlives it, so nothing is left behind however the
        processes end. None on every rank (gloo then) if rank 0 cannot reserve the memory."""
        size = 2 * world_size * _LINE + world_size * slot_bytes
        ok = torch.ones(1, dtype=torch.int32)
        if rank == 0:
            try:
                _create(path, size)
            except OSError as e:
                logger.warning("no shared memory for the tp all-reduce (%s): using gloo", e)
                ok.zero_()
        dist.broadcast(ok, src=dist.get_global_rank(group, 0), group=group)
        if not ok.item():
            return None
        buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        dist.barrier(group=group)
        if rank == 0:
            os.unlink(path)
        return cls(buffer, rank, world_size, slot_bytes)

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= self.slot_bytes

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place, like dist.all_reduce; every rank must call it in the same order."""
        self.calls += 1
        n = self.calls
        self._wait(self.summed, n - 1)  # nobody still reads the slots of the previous call
        nbytes = tensor.numel() * tensor.element_size()
        mine = self.slots[self.rank, :nbytes].view(tensor.dtype).view(tensor.shape)
        mine.copy_(tensor)
        self.arrived[self.rank] = n
        self._wait(self.arrived, n)
        parts = [self.slots[r, :nbytes].view(tensor.dtype).view(tensor.shape)
                 for r in range(self.world_size)]
        if tensor.dtype in (torch.bfloat16, torch.float16):  # accumulate in fp32, round once
            total = parts[0].float()
            for part in parts[1:]:
                total += part
            tensor.copy_(total)
        else:
            tensor.copy_(parts[0])
            for part in parts[1:]:
                tensor += part
        self.summed[self.rank] = n
        return tensor

    def _wait(self, flags: np.ndarray, n: int) -> None:
        if flags.min() >= n:
            return
        start = time.monotonic()
        while flags.min() < n:
            waited = time.monotonic() - start
            if waited < _SPIN_S:
                os.sched_yield()  # a peer may share this core (more ranks than cores)
            elif waited < _TIMEOUT_S:
                time.sleep(5e-5)
            else:
                raise RuntimeError(f"tp rank {self.rank}: a peer did not reach all-reduce "
                                   f"#{n} within {_TIMEOUT_S:.0f} s")

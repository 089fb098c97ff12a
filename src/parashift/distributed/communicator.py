"""One communicator object per process group: every collective a model makes goes through it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from parashift.distributed.shm_all_reduce import ShmAllReduce


@dataclass
class CommStats:
    """What this process's collectives cost (benchmarks read it through the workers)."""

    calls: int = 0
    seconds: float = 0.0
    bytes: int = 0


class GroupCommunicator:
    """Collectives over one process group. At size 1 every collective is the identity, so
    models run unchanged in a single process; a real group (gloo on CPU, nccl on GPU) is passed
    in by the strategy that creates it. On one CPU node, all-reduces that fit go through `shm`.
    The pipeline's point-to-point calls need a neighbour: only stages with one make them.
    `deterministic` (--deterministic): every all-reduce through `shm`, in pieces that fit, so an
    element's sum is the same (fp32, in rank order) whatever the tensor's size."""

    def __init__(self, group: dist.ProcessGroup | None = None, rank: int = 0, world_size: int = 1,
                 shm: ShmAllReduce | None = None, deterministic: bool = False):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.shm = shm
        self.deterministic = deterministic and shm is not None
        self.stats = CommStats()
        self._pending_send: tuple[dist.Work, torch.Tensor] | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            start = time.perf_counter()
            if self.shm is not None and self.shm.fits(tensor):
                self.shm.all_reduce(tensor)
            elif self.deterministic and tensor.is_contiguous():
                for piece in tensor.view(-1).split(self.shm.slot_bytes // tensor.element_size()):
                    self.shm.all_reduce(piece)
            else:
                dist.all_reduce(tensor, group=self.group)
            self._count(start, tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        start = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        self._count(start, tensor)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Block i of `tensor`'s rows goes to rank i; block j of the result came from rank j
        (equal blocks). The group's own call, so that groups outside the default world (the
        expert-parallel group) can make it too."""
        if self.world_size == 1:
            return tensor
        start = time.perf_counter()
        tensor = tensor.contiguous()
        out = torch.empty_like(tensor)
        self.group.alltoall_base(out, tensor, [], [], dist.AllToAllOptions()).wait()
        self._count(start, tensor)
        return out

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks and keep this rank's block of rows ([world * n, ...] ->
        [n, ...])."""
        if self.world_size == 1:
            return tensor
        start = time.perf_counter()
        out = tensor.new_empty(tensor.shape[0] // self.world_size, *tensor.shape[1:])
        dist.reduce_scatter(out, list(tensor.chunk(self.world_size)), group=self.group)
        self._count(start, tensor)
        return out

    def _count(self, start: float, tensor: torch.Tensor) -> None:
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - start
        self.stats.bytes += tensor.numel() * tensor.element_size()

    def gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's tensor on rank 0; other ranks get None."""
        if self.world_size == 1:
            return tensor
        parts = None
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.gather(tensor.contiguous(), parts, dst=dist.get_global_rank(self.group, 0),
                    group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor, on every rank (in place)."""
        if self.world_size > 1:
            start = time.perf_counter()
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group)
            self._count(start, tensor)
        return tensor

    # --- pipeline: point to point along the group (rank i -> rank i + 1) ----------------------
    def send_next(self, tensor: torch.Tensor) -> None:
        """Send to the next rank without waiting for it to receive; the previous send is
        finished first, so at most one buffer is in flight."""
        self.wait_sends()
        dst = dist.get_global_rank(self.group, self.rank + 1)
        tensor = tensor.contiguous()  # kept referenced until the send is done
        self._pending_send = (dist.isend(tensor, dst, group=self.group), tensor)

    def wait_sends(self) -> None:
        if self._pending_send is not None:
            self._pending_send[0].wait()
            self._pending_send = None

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, dist.get_global_rank(self.group, self.rank - 1), group=self.group)
        return out

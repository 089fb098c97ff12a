"""The KV cache tiers of a plan (issue 53): the blocks and tokens of the node's host tier
(--kv-offloading-size, shared by the node's engines) and of its disk tier (--kv-disk-size), in
the engine's own layout (engine/core.py `_kv_tiers`): a slot holds one block of every worker
of an engine, each as wide as the largest worker's block; the host arena keeps whole sets of
WAYS slots beside its index (kv_tiers/host_arena.py), a disk block is a file with a header."""

from __future__ import annotations

from dataclasses import dataclass

from parashift.kv_tiers.disk_tier import HEADER
from parashift.kv_tiers.host_arena import WAYS, HostArena
from parashift.strategies.layout import ProcessPlan
from parashift.strategies.mesh import DeviceMesh


@dataclass(frozen=True)
class TierCapacity:
    size_bytes: int  # the flag's
    slot_bytes: int  # one block of every worker of an engine
    blocks: int
    tokens: int


@dataclass(frozen=True)
class KVTiers:
    """Per node: each node that runs engines has its own arena and disk folder."""

    host: TierCapacity
    disk: TierCapacity | None
    disk_dir: str | None
    engines_per_node: int  # the engines sharing the node's tiers


def host_tier_blocks(size_bytes: int, slot_bytes: int) -> int:
    """The slots HostArena.open makes of `size_bytes`: the most whole sets whose file, index
    included, fits (0 where not one set does; the engine refuses that size)."""
    low, high = 0, size_bytes // slot_bytes // WAYS + 1  # high sets never fit
    while high - low > 1:
        mid = (low + high) // 2
        if HostArena.file_bytes(mid * WAYS, slot_bytes) <= size_bytes:
            low = mid
        else:
            high = mid
    return low * WAYS


def disk_tier_blocks(size_bytes: int, slot_bytes: int) -> int:
    """DiskTier.capacity: one file per block, its header and the slot's bytes."""
    return size_bytes // (HEADER.size + slot_bytes)


def node_kv_tiers(worker_bytes: int, processes: ProcessPlan, mesh: DeviceMesh | None,
                  host_size: int | None, disk_size: int | None, disk_dir: str | None,
                  block_size: int) -> tuple[KVTiers | None, list[str]]:
    """The tiers (None when off) and why the engine would refuse them. `worker_bytes`: the
    largest worker's block (estimate.kv_block_bytes); the sizes: the tier flags."""
    if not host_size:
        return None, []
    errors = []
    if processes.lockstep:
        errors.append("--kv-offloading-size is not supported with lockstep expert parallel yet")
    slot_bytes = worker_bytes * processes.workers_per_engine
    blocks = host_tier_blocks(host_size, slot_bytes)
    if blocks < WAYS:
        least = HostArena.file_bytes(WAYS, slot_bytes)
        errors.append(f"--kv-offloading-size {host_size / 2**20:.1f} MiB holds fewer than "
                      f"{WAYS} KV blocks of {slot_bytes} bytes: give it at least "
                      f"{-(-least * 10 // 2**20) / 10:.1f} MiB")
    host = TierCapacity(host_size, slot_bytes, blocks, blocks * block_size)
    disk = None
    if disk_size:
        disk_blocks = disk_tier_blocks(disk_size, slot_bytes)
        if not disk_blocks:
            errors.append(f"--kv-disk-size {disk_size} bytes holds no block of "
                          f"{HEADER.size + slot_bytes} bytes: raise it or drop the disk tier")
        disk = TierCapacity(disk_size, slot_bytes, disk_blocks, disk_blocks * block_size)
    return KVTiers(host, disk, disk_dir, _engines_per_node(processes, mesh)), errors


def _engines_per_node(processes: ProcessPlan, mesh: DeviceMesh | None) -> int:
    """The most engines any node runs (with a mesh, as it places them)."""
    if mesh is None or not mesh.ranks:
        return processes.num_engines
    nodes = [node for node, _ in {(r.node, r.engine) for r in mesh.ranks}]
    return max(nodes.count(node) for node in set(nodes))

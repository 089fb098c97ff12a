"""Shared-memory all-reduce between real processes (gloo only to meet and for big tensors):
sums are right and the same bits on every rank, call after call, with more ranks than cores,
and nothing stays in /dev/shm. With --deterministic a big tensor goes through shared memory
in pieces: its sums are the exact fp32, rank-order ones too."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist

from parashift.distributed import shm_all_reduce
from parashift.distributed.communicator import GroupCommunicator
from parashift.distributed.shm_all_reduce import ShmAllReduce

SLOT_BYTES = 64 << 10
CALLS = 150

pytestmark = pytest.mark.skipif(not shm_all_reduce.supported(), reason="x86 only")


def part(call: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """What `rank` contributes to all-reduce number `call`: sizes straddle the slot."""
    gen = torch.Generator().manual_seed(1000 * call + rank)
    numel = [7, 1024, 16_384, 40_000][call % 4]  # the last exceeds a 64 KiB slot: gloo
    return torch.randn(numel, generator=gen).to(dtype)


def run_rank(rank: int, world: int, folder: str, dtype_name: str,
             deterministic: bool = False) -> None:
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank,
                            world_size=world)
    path = os.path.join(folder, "all-reduce")
    shm = ShmAllReduce.open(path, rank, world, dist.group.WORLD, SLOT_BYTES)
    dist.barrier()
    assert not os.path.exists(path)  # unlinked by rank 0 once everyone mapped it
    comm = GroupCommunicator(dist.group.WORLD, rank, world, shm, deterministic)
    outputs = []
    for call in range(CALLS):
        x = part(call, rank, dtype)
        comm.all_reduce(x)
        parts = [part(call, r, dtype).float() for r in range(world)]
        expected = parts[0]
        for p in parts[1:]:
            expected = expected + p
        if shm.fits(x) or deterministic:  # same order, fp32 accumulation: exact
            assert torch.equal(x, expected.to(dtype)), call
        else:
            torch.testing.assert_close(x.float(), expected, rtol=2e-2, atol=2e-2)
        outputs.append(x)
    big = -(-40_000 * dtype.itemsize // SLOT_BYTES) if deterministic else 0  # its pieces
    assert comm.stats.calls == CALLS and shm.calls == CALLS - CALLS // 4 + big * (CALLS // 4)
    torch.save(outputs, os.path.join(folder, f"out{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world, dtype, deterministic", [
    (2, "float32", False), (2, "bfloat16", False), (4, "float32", False),
    (4, "bfloat16", True)])
def test_sums_are_right_and_identical_on_every_rank(tmp_path, world, dtype, deterministic):
    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=run_rank, args=(r, world, str(tmp_path), dtype, deterministic))
             for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    for proc in procs:  # a failed rank leaves its peers waiting in a collective
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * world
    outs = [torch.load(tmp_path / f"out{r}.pt") for r in range(world)]
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other, strict=True))
    assert not any(name.startswith("all-reduce") for name in os.listdir(tmp_path))


def open_where_nothing_can_be_created(rank: int, world: int, folder: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank,
                            world_size=world)
    path = os.path.join(folder, "no-such-folder", "all-reduce")
    assert ShmAllReduce.open(path, rank, world, dist.group.WORLD, SLOT_BYTES) is None
    dist.destroy_process_group()


def test_every_rank_falls_back_to_gloo_when_rank_0_cannot_create_the_mapping(tmp_path):
    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=open_where_nothing_can_be_created, args=(r, 2, str(tmp_path)))
             for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]


def test_a_peer_that_never_comes_is_an_error_not_a_hang(tmp_path, monkeypatch):
    buffer = torch.zeros(2 * 2 * 64 + 2 * 1024, dtype=torch.uint8)
    shm = ShmAllReduce(buffer, 0, 2, 1024)
    monkeypatch.setattr(shm_all_reduce, "_TIMEOUT_S", 0.05)
    with pytest.raises(RuntimeError, match="did not reach all-reduce #1"):
        shm.all_reduce(torch.ones(4))

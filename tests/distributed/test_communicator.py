"""GroupCommunicator, the one object every collective goes through: at size 1 each collective
is the identity (a model runs unchanged in one process); over a real 2-rank gloo group the
collectives move the right blocks and count their calls and bytes. The group is the
expert-parallel one, met at the launcher's store by two threads, and the expert dispatch runs
over it; the calls that need the default world (gather, the pipeline's sends) run in two
processes."""

from __future__ import annotations

import concurrent.futures
import multiprocessing

import pytest
import torch
import torch.distributed as dist
import zmq

from parashift.distributed.communicator import GroupCommunicator
from parashift.distributed.expert_dispatch import ExpertDispatcher
from parashift.distributed.expert_group import cross_engine_groups, join_expert_group
from parashift.distributed.group_store import GroupStoreServer
from parashift.distributed.parallel_context import ParallelContext
from parashift.strategies.layout import ShardPlan
from parashift.strategies.spec import StrategySpec


def test_at_size_1_every_collective_is_the_identity():
    comm = GroupCommunicator()
    x = torch.arange(6.0).view(2, 3)
    for out in (comm.all_reduce(x), comm.all_gather(x), comm.all_gather(x, dim=0),
                comm.all_to_all(x), comm.reduce_scatter(x), comm.gather(x)):
        assert out is x
    assert torch.equal(x, torch.arange(6.0).view(2, 3))
    comm.wait_sends()  # nothing in flight
    assert (comm.stats.calls, comm.stats.bytes) == (0, 0)


def test_a_group_a_rank_is_not_split_over_answers_at_size_1():
    context = ParallelContext()
    assert context.tp.world_size == 1 and context.group("ep").world_size == 1
    with pytest.raises(ValueError, match="splits over tp2 but the tp group has 1 rank"):
        ParallelContext(shard=ShardPlan(tp_rank=0, tp_size=2))


def two_ranks(work):
    """`work(comm, rank)` on both ranks of a real gloo group (the expert-parallel group,
    joined at a store like the launcher's), one thread each; their results in rank order."""
    ctx = zmq.Context()
    store = GroupStoreServer(ctx, "tcp://127.0.0.1:0")
    store.start()

    def rank(r: int):
        comm = join_expert_group(store.address, None, {"dp": r}, {"dp": 2}, on_gpu=False)
        assert (comm.rank, comm.world_size) == (r, 2)
        return work(comm, r)

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return [f.result(timeout=120) for f in [pool.submit(rank, r) for r in (0, 1)]]
    finally:
        store.stop()
        ctx.destroy(linger=0)


def test_collectives_over_two_ranks_move_the_right_blocks_and_are_counted():
    def work(comm: GroupCommunicator, r: int):
        summed = torch.full((2, 3), float(r + 1))
        assert comm.all_reduce(summed) is summed  # in place
        return (summed,
                comm.all_gather(torch.tensor([[r, 10 + r]]), dim=-1),  # [1, 2] -> [1, 4]
                comm.all_gather(torch.tensor([[r, 10 + r]]), dim=0),  # [1, 2] -> [2, 2]
                comm.all_to_all(torch.arange(4).view(4, 1) + 10 * r),  # block i -> rank i
                comm.reduce_scatter(torch.arange(4.0).view(4, 1) * (r + 1)),
                (comm.stats.calls, comm.stats.bytes))

    for r, (summed, gathered, stacked, exchanged, scattered, stats) in enumerate(two_ranks(work)):
        assert torch.equal(summed, torch.full((2, 3), 3.0))
        assert gathered.tolist() == [[0, 10, 1, 11]]
        assert stacked.tolist() == [[0, 10], [1, 11]]
        # Rank r gets block r (rows 2r, 2r+1) of every rank, rank 0's first.
        assert exchanged.flatten().tolist() == [2 * r, 2 * r + 1, 10 + 2 * r, 11 + 2 * r]
        # The sum over ranks of [0, 1, 2, 3] * (rank + 1), rows 2r and 2r+1 kept.
        assert scattered.flatten().tolist() == [3.0 * (2 * r), 3.0 * (2 * r + 1)]
        assert stats == (5, 2 * 3 * 4 + 2 * 2 * 8 + 4 * 8 + 4 * 4)


def test_the_expert_dispatch_over_two_ranks_pads_gathers_and_sums_back():
    """Rank 0 has 3 tokens, rank 1 one (or none, in a dummy step): every rank sees every
    rank's tokens padded to 3, and gets back its own rows summed over the ranks' experts."""
    hidden = 4

    def work(comm: GroupCommunicator, r: int):
        dispatcher = ExpertDispatcher(comm)
        assert dispatcher.is_active and dispatcher.over_all_to_all  # gloo: all-to-alls
        num_tokens = [3, 1][r]
        tokens = torch.arange(num_tokens * hidden, dtype=torch.float32).view(-1, hidden)
        tokens += 100 * r
        any_work = dispatcher.begin_step(num_tokens, has_work=r == 0)
        counts = list(dispatcher.counts)
        everyone = dispatcher.dispatch(tokens)  # [2 * 3, hidden]
        valid = dispatcher.valid_rows(torch.device("cpu"))
        # Each rank's "experts" contribute (rank + 1) x every token: the sum is 3 x token.
        mine = dispatcher.combine(everyone * (r + 1), num_tokens)
        idle = dispatcher.begin_step(0, has_work=False)  # a step where no rank has work
        return any_work, counts, everyone, valid, tokens, mine, idle

    results = two_ranks(work)
    rows = [results[0][4], results[1][4]]
    padded = torch.zeros(6, hidden)
    padded[0:3], padded[3:4] = rows[0], rows[1]
    for any_work, counts, everyone, valid, tokens, mine, idle in results:
        assert any_work is True and idle is False
        assert counts == [3, 1]
        assert torch.equal(everyone, padded)
        assert valid.tolist() == [True, True, True, True, False, False]
        assert torch.equal(mine, 3 * tokens)


def test_only_expert_parallel_over_engines_makes_a_cross_engine_group():
    assert cross_engine_groups(StrategySpec.parse("dp2"), None, None, {"dp": 0}, False) == {}
    assert cross_engine_groups(StrategySpec.parse("tp2xep"), None, None, {"tp": 0}, False) == {}
    with pytest.raises(ValueError, match="runs only under 'parashift run'"):
        cross_engine_groups(StrategySpec.parse("dp2xep"), None, None, {"dp": 0}, False)


def gather_and_pipeline(rank: int, folder: str) -> None:
    """Rank `rank` of a 2-process default world: the calls that name global ranks."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/init", rank=rank,
                            world_size=2)
    try:
        comm = GroupCommunicator(dist.group.WORLD, rank, 2)
        gathered = comm.gather(torch.full((1, 2), float(rank)), dim=0)
        if rank == 0:
            assert gathered.tolist() == [[0.0, 0.0], [1.0, 1.0]]
        else:
            assert gathered is None
        # The pipeline: stage 0 sends two buffers without waiting, stage 1 receives them.
        if rank == 0:
            comm.send_next(torch.arange(6.0).view(2, 3))
            comm.send_next(torch.ones(2, 3))  # waits for the first send first
            comm.wait_sends()
        else:
            first = comm.recv_prev((2, 3), torch.float32, torch.device("cpu"))
            second = comm.recv_prev((2, 3), torch.float32, torch.device("cpu"))
            assert torch.equal(first, torch.arange(6.0).view(2, 3))
            assert torch.equal(second, torch.ones(2, 3))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_gather_and_the_pipelines_sends_over_two_processes(tmp_path):
    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=gather_and_pipeline, args=(r, str(tmp_path))) for r in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    for proc in procs:  # a failed rank leaves its peer waiting in a collective
        if proc.is_alive():
            proc.kill()
            proc.join()
    assert [proc.exitcode for proc in procs] == [0, 0]

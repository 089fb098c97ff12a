"""The two ways to move MoE tokens between expert-parallel ranks, timed alone over a real gloo
(or nccl) group of `ranks` processes, one core each, at given token counts per rank:

- all-gather + reduce-scatter, torch's own calls: every rank gets every token (padded to the
  largest rank); the outputs come back summed. Two collectives of fixed shape per layer.
- the same gather and scatter-sum as equal-block all-to-alls (what
  distributed/expert_dispatch.py does on gloo).
- routed all-to-all: each token goes only to the ranks that hold one of its top-k experts,
  and the results come back the same way; the split sizes must be exchanged first (a third,
  small all-to-all per layer).

Routing is uniform at random, as for a balanced router."""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parashift.strategies.expert import expert_range


def _worker(rank: int, ranks: int, store_path: str, tokens: int, hidden: int, experts: int,
            top_k: int, iterations: int, out: dict) -> None:
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    store = dist.FileStore(store_path, ranks)  # one node: no port to pick
    group = dist.ProcessGroupGloo(store, rank, ranks, datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g)
    owner = torch.zeros(experts, dtype=torch.long)
    for r in range(ranks):
        first, end = expert_range(experts, ranks, r)
        owner[first:end] = r

    def gather_scatter() -> None:
        parts = [torch.empty_like(x) for _ in range(ranks)]
        dist.all_gather(parts, x, group=group)
        result = torch.cat(parts)
        back = torch.empty_like(x)
        dist.reduce_scatter(back, list(result.chunk(ranks)), group=group)

    def gather_scatter_over_all_to_all() -> None:
        gathered = torch.empty(ranks * tokens, hidden)
        exchange(gathered, x.repeat(ranks, 1), [], [])
        back = torch.empty_like(gathered)
        exchange(back, gathered, [], [])
        back.view(ranks, tokens, hidden).sum(0)

    def routed_all_to_all() -> None:
        ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
        dest = torch.zeros(tokens, ranks, dtype=torch.bool)
        dest[torch.arange(tokens)[:, None], owner[ids]] = True  # a copy per rank, not expert
        rows, ranks_of = dest.nonzero(as_tuple=True)
        order = ranks_of.argsort(stable=True)
        send = x[rows[order]]
        send_counts = torch.bincount(ranks_of, minlength=ranks)
        recv_counts = torch.empty_like(send_counts)
        exchange(recv_counts, send_counts, [1] * ranks, [1] * ranks)
        splits_out, splits_in = send_counts.tolist(), recv_counts.tolist()
        received = send.new_empty(sum(splits_in), hidden)
        exchange(received, send, splits_in, splits_out)
        returned = send.new_empty(send.shape)
        exchange(returned, received, splits_out, splits_in)

    def exchange(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                 in_splits: list[int]) -> None:
        # the group's own call: dist.all_to_all_single wants a group registered in the world
        group.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()).wait()

    times = {}
    for name, fn in (("all-gather+reduce-scatter", gather_scatter),
                     ("gather/scatter over all-to-all", gather_scatter_over_all_to_all),
                     ("routed all-to-all", routed_all_to_all)):
        for _ in range(3):
            fn()
        dist.barrier(group=group)
        samples = []
        for _ in range(iterations):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    if rank == 0:
        out.update(times)


def time_dispatch(tokens: int, hidden: int, experts: int, top_k: int, ranks: int = 2,
                  iterations: int = 50) -> dict[str, float]:
    """Median seconds of one MoE layer's token exchange, each way."""
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as folder:
        out = manager.dict()
        mp.spawn(_worker, args=(ranks, os.path.join(folder, "store"), tokens, hidden, experts,
                                top_k, iterations, out), nprocs=ranks)
        return dict(out)

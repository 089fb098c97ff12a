"""The in-process side of `parashift bench`: offline throughput (one engine here, or one
process per data-parallel rank, each on its own cores and its share of the requests) and the
latency of one batch."""

from __future__ import annotations

import dataclasses
import multiprocessing
import time

import msgspec

from parashift.bench.datasets import BenchRequest
from parashift.engine.args import EngineArgs, create_config
from parashift.engine.placement import node_mesh


def _params(requests: list[BenchRequest], sampling: dict | None = None):
    """`sampling`: the fields of `bench --sampling` (None: greedy)."""
    from parashift import SamplingParams

    fields = sampling or {"temperature": 0.0}
    return [SamplingParams(max_tokens=r.output_len, ignore_eos=True, **fields)
            for r in requests]


@dataclasses.dataclass
class ThroughputRun:
    elapsed_s: list[float]  # seconds to finish every request, one per timed run
    token_ids: list[list[int]] | None = None  # the last run's outputs (one engine only)


def _generate(engine_args: EngineArgs, requests: list[BenchRequest], progress: bool,
              repeat: int, sampling: dict | None) -> ThroughputRun:
    from parashift import LLM

    llm = LLM.from_engine_args(engine_args)
    try:
        warm = requests[0].prompt
        llm.generate([warm[:16] if isinstance(warm, list) else warm],
                     _params([dataclasses.replace(requests[0], output_len=2)]), use_tqdm=False)
        times = []
        for _ in range(repeat):
            llm.engine.reset_prefix_cache()  # a repeat must not hit the last run's prompts
            start = time.perf_counter()
            outputs = llm.generate([r.prompt for r in requests], _params(requests, sampling),
                                   use_tqdm=progress)
            times.append(time.perf_counter() - start)
    finally:
        llm.shutdown()
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    for i, (ids, r) in enumerate(zip(token_ids, requests, strict=True)):
        if len(ids) != r.output_len:  # ignore_eos: anything else would skew tokens/s
            raise RuntimeError(f"request {i} produced {len(ids)} tokens, asked {r.output_len}")
    return ThroughputRun(times, token_ids)


def run_throughput(engine_args: EngineArgs, requests: list[BenchRequest],
                   progress: bool = True, repeat: int = 1,
                   sampling: dict | None = None) -> ThroughputRun:
    """Seconds to finish every request, `repeat` times (greedy, or with `sampling`'s fields).
    dp > 1: each rank's process takes every dp-th request and they start each run together;
    the slowest rank's time counts."""
    config = create_config(engine_args)  # validates, converts a GGUF once
    spec = config.parallel.strategy
    dp = spec.processes().num_engines
    if dp == 1:
        return _generate(engine_args, requests, progress, repeat, sampling)
    mesh = node_mesh(spec, config.device.device, list(range(dp)))
    # Each rank's process runs one engine: the strategy without its data-parallel axis.
    engine_strategy = "x".join(a.token for a in spec.axes
                               if not (a.mesh() and a.mesh().spans_engines)) or "dp1"
    mp = multiprocessing.get_context("spawn")
    barrier = mp.Barrier(dp)
    pipes, procs = [], []
    for rank in range(dp):
        receive, send = mp.Pipe(duplex=False)
        args = dataclasses.replace(engine_args, model=config.model.path,
                                   strategy=engine_strategy, data_parallel_size=None,
                                   tensor_parallel_size=None, pipeline_parallel_size=None)
        proc = mp.Process(target=_rank_main, name=f"parashift-bench-dp{rank}", args=(
            rank, args, requests[rank::dp], mesh.engine_placement(rank).cpu_ids, barrier, send,
            progress and rank == 0, repeat, sampling))
        proc.start()
        send.close()  # the child holds the write end: its death then reads as EOF here
        procs.append(proc)
        pipes.append(receive)
    try:
        per_rank = _gather(pipes, procs)
        return ThroughputRun([max(run) for run in zip(*per_rank, strict=True)])
    finally:
        barrier.abort()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _gather(pipes: list, procs: list[multiprocessing.Process]) -> list[list[float]]:
    """Every rank's times; a rank that fails or dies stops the run with its error."""
    from multiprocessing.connection import wait

    times: dict[int, list[float]] = {}
    while len(times) < len(procs):
        waiting = {r: (pipes[r], procs[r].sentinel) for r in range(len(procs)) if r not in times}
        ready = set(wait([x for pair in waiting.values() for x in pair]))
        for rank, (pipe, sentinel) in waiting.items():
            if pipe in ready and pipe.poll():
                result = msgspec.json.decode(pipe.recv_bytes())
                if isinstance(result, str):
                    raise RuntimeError(result)
                times[rank] = result
            elif sentinel in ready and not pipe.poll():
                procs[rank].join(5)
                raise RuntimeError(f"bench rank dp{rank} exited with code {procs[rank].exitcode}")
    return [times[r] for r in range(len(procs))]


def _rank_main(rank: int, engine_args: EngineArgs, requests: list[BenchRequest],
               cpu_ids: tuple[int, ...], barrier, pipe, progress: bool, repeat: int,
               sampling: dict | None) -> None:
    """One data-parallel rank: an independent engine on its cores from the mesh (its engine
    places its own workers on them, by the same rule)."""
    import os

    from parashift.processes import die_with_parent

    die_with_parent()
    if cpu_ids:
        os.sched_setaffinity(0, cpu_ids)
    try:
        from parashift import LLM

        llm = LLM.from_engine_args(engine_args)
        llm.generate([[100 + i for i in range(16)]], _params(
            [BenchRequest([], 16, 2)]), use_tqdm=False)
        times = []
        for _ in range(repeat):
            llm.engine.reset_prefix_cache()
            barrier.wait()
            start = time.perf_counter()
            llm.generate([r.prompt for r in requests], _params(requests, sampling),
                         use_tqdm=progress)
            times.append(time.perf_counter() - start)
        pipe.send_bytes(msgspec.json.encode(times))
        llm.shutdown()
    except Exception as e:  # the parent reports it
        pipe.send_bytes(msgspec.json.encode(f"dp{rank}: {e}"))


def run_latency(engine_args: EngineArgs, batch_size: int, input_len: int, output_len: int,
                iters: int, warmup: int, progress: bool = True,
                sampling: dict | None = None) -> list[float]:
    """Seconds per batch (prefill + every decode step) for `iters` timed runs."""
    from tqdm import tqdm

    from parashift import LLM

    llm = LLM.from_engine_args(engine_args)
    try:
        vocab = llm.config.model.vocab_size
        prompts = [[(100 + 31 * b + 7 * i) % max(1, vocab - 100) for i in range(input_len)]
                   for b in range(batch_size)]
        params = _params([BenchRequest([], input_len, output_len)] * batch_size, sampling)
        latencies = []
        bar = tqdm(total=warmup + iters, desc="latency", unit="batch", disable=not progress)
        for i in range(warmup + iters):
            llm.engine.reset_prefix_cache()  # every batch prefills in full
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if i >= warmup:
                latencies.append(time.perf_counter() - start)
            bar.update()
        bar.close()
        return latencies
    finally:
        llm.shutdown()

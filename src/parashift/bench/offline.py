"""The in-process side of `parashift bench`: offline throughput (one engine here, or one
process per data-parallel rank, each on its own cores and its share of the requests) and the
latency of one batch."""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from typing import TYPE_CHECKING

import msgspec

from parashift.bench.datasets import BenchRequest
from parashift.engine.args import EngineArgs
from parashift.engine.placement import node_mesh

if TYPE_CHECKING:
    from parashift.config import EngineConfig


def sampling_params(output_len: int, sampling: dict | None = None):
    """`output_len` tokens, always; `sampling`: the fields of `bench --sampling` (None:
    greedy)."""
    from parashift import SamplingParams

    return SamplingParams(max_tokens=output_len, ignore_eos=True,
                          **(sampling or {"temperature": 0.0}))


def _params(requests: list[BenchRequest], sampling: dict | None = None):
    return [sampling_params(r.output_len, sampling) for r in requests]


@dataclasses.dataclass
class ThroughputRun:
    elapsed_s: list[float]  # seconds to finish every request, one per timed run
    token_ids: list[list[int]] | None = None  # the last run's outputs (one engine only)


def _timed_runs(llm, requests: list[BenchRequest], progress: bool, repeat: int,
                sampling: dict | None, barrier=None) -> tuple[list[float], list]:
    """Seconds of each run of every request, after a two-token warm-up, and the last run's
    outputs. `barrier`: the data-parallel ranks start each run together."""
    warm = requests[0].prompt if requests else [100 + i for i in range(16)]
    llm.generate([warm[:16] if isinstance(warm, list) else warm], [sampling_params(2)],
                 use_tqdm=False)
    times, outputs = [], []
    for _ in range(repeat):
        llm.engine.reset_prefix_cache()  # a repeat must not hit the last run's prompts
        if barrier is not None:
            barrier.wait()
        start = time.perf_counter()
        outputs = llm.generate([r.prompt for r in requests], _params(requests, sampling),
                               use_tqdm=progress)
        times.append(time.perf_counter() - start)
    return times, outputs


def run_throughput(engine_args: EngineArgs, config: EngineConfig,
                   requests: list[BenchRequest], progress: bool = True, repeat: int = 1,
                   sampling: dict | None = None) -> ThroughputRun:
    """Seconds to finish every request, `repeat` times (greedy, or with `sampling`'s fields);
    `config`: what `engine_args` resolve to (create_config), resolved once by the caller.
    dp > 1: each rank's process takes every dp-th request and they start each run together;
    the slowest rank's time counts."""
    spec = config.parallel.strategy
    dp = spec.processes().num_engines
    if dp == 1:
        from parashift import LLM

        llm = LLM.from_config(config)
        try:
            times, outputs = _timed_runs(llm, requests, progress, repeat, sampling)
        finally:
            llm.shutdown()
        token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        for i, (ids, r) in enumerate(zip(token_ids, requests, strict=True)):
            if len(ids) != r.output_len:  # ignore_eos: anything else would skew tokens/s
                raise RuntimeError(f"request {i} produced {len(ids)} tokens, asked "
                                   f"{r.output_len}")
        return ThroughputRun(times, token_ids)
    mesh = node_mesh(spec, config.device.device, list(range(dp)))
    # Each rank's process runs one engine: the strategy without its data-parallel axis.
    engine_strategy = "x".join(a.token for a in spec.axes
                               if not (a.mesh() and a.mesh().spans_engines)) or "dp1"
    args = dataclasses.replace(engine_args, model=config.model.path, strategy=engine_strategy,
                               data_parallel_size=None, tensor_parallel_size=None,
                               pipeline_parallel_size=None)
    mp = multiprocessing.get_context("spawn")
    barrier = mp.Barrier(dp)
    pipes, procs = [], []
    for rank in range(dp):
        receive, send = mp.Pipe(duplex=False)
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
        times, _ = _timed_runs(llm, requests, progress, repeat, sampling, barrier)
        pipe.send_bytes(msgspec.json.encode(times))
        llm.shutdown()
    except Exception as e:  # the parent reports it
        pipe.send_bytes(msgspec.json.encode(f"dp{rank}: {e}"))


def latency_prompts(vocab_size: int, batch_size: int, input_len: int) -> list[list[int]]:
    """A batch of distinct token-id prompts, the same in every latency run."""
    return [[(100 + 31 * b + 7 * i) % max(1, vocab_size - 100) for i in range(input_len)]
            for b in range(batch_size)]


def run_latency(llm, batch_size: int, input_len: int, output_len: int, iters: int,
                warmup: int, progress: bool = True, sampling: dict | None = None
                ) -> list[float]:
    """Seconds per batch (prefill + every decode step) for `iters` timed runs."""
    from tqdm import tqdm

    prompts = latency_prompts(llm.config.model.vocab_size, batch_size, input_len)
    params = sampling_params(output_len, sampling)
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

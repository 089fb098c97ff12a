"""`python scripts/bench_tp.py`: tensor parallel on CPU. Per-step decode latency and throughput
of tp1 (one core) and each tp > 1 (that many worker processes), and the share of the decode time
spent in all-reduce; every tp > 1 is measured twice, all-reducing through shared memory (the
default) and through gloo only. Decode time per step = (time for N tokens - time for 1) / (N -
1): the prefill drops out. Each layout also reports the peak memory its workers' model loads
added."""

from __future__ import annotations

import statistics
import time
from typing import Annotated, Any

import typer
from study_options import Dtype, Repeat
from study_probes import EXTENSION

from parashift.bench.options import SaveJson
from parashift.cli_options import ModelArg, fail, parse_counts, setup_logging


def measure(model: str, tp: int, dtype: str, batch: int, steps: int, repeat: int,
            shm: bool = True) -> dict[str, Any]:
    from parashift import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, tensor_parallel_size=tp, max_model_len=512,
              kv_cache_memory=256 << 20, num_threads=1 if tp == 1 else None,
              worker_extension_cls=EXTENSION, disable_shm_all_reduce=not shm)
    try:
        vocab = llm.config.model.vocab_size
        prompts = [[(100 + 7 * i + j) % vocab for j in range(16)] for i in range(batch)]

        def run(tokens: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            llm.engine.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start

        executor = llm.engine.executor
        # Peak resident memory each worker's model load added: a shard reads only its slice.
        peaks = (executor.collective_rpc("load_peak_rss_bytes") if tp > 1
                 else [executor.worker.load_peak_rss_bytes()])
        comm = ((lambda: executor.collective_rpc("take_comm_stats")[0]) if tp > 1
                else (lambda: None))
        run(2)  # warm-up
        step_s, comm_runs = [], []
        for _ in range(repeat):
            one = run(1)
            comm()
            many = run(steps)
            stats = comm()
            step_s.append((many - one) / (steps - 1))
            if stats is not None:  # all-reduce seconds of tp rank 0 over the whole N-token run
                comm_runs.append((stats["seconds"] / many, stats["calls"] / steps))
    finally:
        llm.shutdown()
    median = statistics.median(step_s)
    out = {"tp": tp, "all_reduce": "none" if tp == 1 else "shm" if shm else "gloo",
           "step_ms": [s * 1e3 for s in step_s], "median_step_ms": median * 1e3,
           "min_step_ms": min(step_s) * 1e3, "decode_tokens_per_s": batch / median,
           "load_peak_rss_mib": [p / 2**20 for p in peaks]}
    if comm_runs:
        out["allreduce_fraction"] = statistics.median(f for f, _ in comm_runs)
        out["allreduces_per_step"] = comm_runs[0][1]
    return out


def tp(
    model: ModelArg = None,
    hidden: Annotated[int, typer.Option(help="random Llama (without MODEL): hidden size")] = 1024,
    intermediate: Annotated[int, typer.Option(help="its MLP size")] = 4096,
    layers: Annotated[int, typer.Option(help="its layers")] = 24,
    heads: Annotated[int, typer.Option(help="its attention heads")] = 16,
    kv_heads: Annotated[int, typer.Option("--kv-heads", help="its kv heads")] = 8,
    vocab: Annotated[int, typer.Option(help="its vocabulary")] = 32000,
    tp_sizes: Annotated[str, typer.Option("--tp", help="tensor-parallel sizes, e.g. 1,2,4")
                        ] = "1,2",
    dtype: Dtype = "float32",
    batch: Annotated[int, typer.Option(help="sequences decoded together")] = 8,
    steps: Annotated[int, typer.Option(help="tokens of the long run (N)")] = 24,
    repeat: Repeat = 3,
    save_json: SaveJson = None,
) -> None:
    """Decode step time of tp1 and tp > 1 (shared-memory and gloo all-reduce) on a random Llama
    or MODEL."""
    setup_logging()
    from random_model import random_llama

    from parashift.bench import report

    sizes = parse_counts(tp_sizes, "--tp", "1,2,4")
    for flag, value, least in (("--batch", batch, 1), ("--steps", steps, 2),
                               ("--repeat", repeat, 1), ("--hidden", hidden, 1),
                               ("--intermediate", intermediate, 1), ("--layers", layers, 1),
                               ("--heads", heads, 1), ("--kv-heads", kv_heads, 1),
                               ("--vocab", vocab, 1)):
        if value < least:
            fail(f"{flag} must be >= {least}")
    if model is None and (hidden % heads or heads % kv_heads):
        fail(f"--hidden {hidden} must split into --heads {heads}, and those into --kv-heads "
             f"{kv_heads}")
    try:
        folder = model or random_llama(hidden, intermediate, layers, heads, kv_heads, vocab)
        results = []
        for size, shm in ((s, shm) for s in sizes for shm in (True, False)):
            if size == 1 and not shm:
                continue
            label = f"tp{size}" + ("" if size == 1 else " shm" if shm else " gloo")
            typer.echo(f"{label} ...")
            r = measure(folder, size, dtype, batch, steps, repeat, shm)
            results.append(r)
            extra = (f", all-reduce {100 * r['allreduce_fraction']:.1f}% of the run "
                     f"({r['allreduces_per_step']:.0f} per step)" if "allreduce_fraction" in r
                     else "")
            rss = " / ".join(f"{m:.0f}" for m in r["load_peak_rss_mib"])
            typer.echo(f"{label}: decode step median {r['median_step_ms']:.1f} ms (min "
                       f"{r['min_step_ms']:.1f}), {r['decode_tokens_per_s']:.1f} tok/s at batch "
                       f"{batch}{extra}; model load peak RSS {rss} MiB per worker")
    except ValueError as e:
        fail(str(e))
    base = results[0]["median_step_ms"]
    for r in results[1:]:
        typer.echo(f"speed-up tp{r['tp']} ({r['all_reduce']}) over tp{results[0]['tp']}: "
                   f"{base / r['median_step_ms']:.2f}x")
    if save_json:
        report.save_json(save_json, "tp", {
            "model": folder, "tp": sizes, "dtype": dtype, "batch": batch, "steps": steps,
            "repeat": repeat}, {"results": results})


if __name__ == "__main__":
    typer.run(tp)

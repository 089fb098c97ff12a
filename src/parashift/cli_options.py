"""Command-line pieces shared by `parashift run`, `generate` and `bench`: vLLM's engine flags
as typer option types, and turning them into EngineArgs."""

from __future__ import annotations

import logging
import re
import sys
from typing import Annotated

import typer

from parashift import env

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise typer.BadParameter(f"{text!r} is not a size like 2GiB or 512MiB", param_hint=flag)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def setup_logging() -> None:
    logging.basicConfig(level=env.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


# Engine flags shared by `generate` and `run` (vLLM's names).
ModelArg = Annotated[str | None, typer.Argument(
    help="Hugging Face folder or .gguf file; default: the embedded SmolLM2-135M-Instruct")]
Dtype = Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")]
MaxModelLen = Annotated[int | None, typer.Option("--max-model-len")]
MaxNumSeqs = Annotated[int, typer.Option("--max-num-seqs")]
MaxBatchedTokens = Annotated[int | None, typer.Option("--max-num-batched-tokens")]
BlockSize = Annotated[int, typer.Option("--block-size")]
KvCacheMemory = Annotated[str | None, typer.Option(
    "--kv-cache-memory", help="KV cache budget on CPU, e.g. 2GiB")]
GpuMemoryUtilization = Annotated[float, typer.Option("--gpu-memory-utilization")]
PrefixCaching = Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching")]
Threads = Annotated[int | None, typer.Option(help="CPU threads for torch")]
Strategy = Annotated[str | None, typer.Option(
    help="parallel layout: axes joined by x, e.g. dp2, tp2, dp4xtp2")]
DataParallel = Annotated[int | None, typer.Option("--data-parallel-size", "-dp")]
TensorParallel = Annotated[int | None, typer.Option("--tensor-parallel-size", "-tp")]
PipelineParallel = Annotated[int | None, typer.Option("--pipeline-parallel-size", "-pp")]
ExpertParallel = Annotated[bool, typer.Option("--enable-expert-parallel")]


def make_engine_args(model, dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
                     block_size, kv_cache_memory, gpu_memory_utilization, enable_prefix_caching,
                     threads, strategy, dp, tp, pp, ep, seed: int = 0):
    from parashift.engine.args import EngineArgs

    kv_bytes = parse_size(kv_cache_memory, "--kv-cache-memory") if kv_cache_memory else None
    return EngineArgs(model=model, dtype=dtype, max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      block_size=block_size, kv_cache_memory=kv_bytes,
                      gpu_memory_utilization=gpu_memory_utilization,
                      enable_prefix_caching=enable_prefix_caching, seed=seed, num_threads=threads,
                      strategy=strategy, data_parallel_size=dp, tensor_parallel_size=tp,
                      pipeline_parallel_size=pp, enable_expert_parallel=ep)

"""Command-line pieces shared by `parashift run`, `generate`, `bench` and `plan`: vLLM's engine
flags as typer option types, and `engine_options`, which gives a command all of them at once
(or, for `plan`, the ones a dry run reads)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

import typer

from parashift import env
from parashift.defaults import (
    ATTENTION_BACKENDS,
    DTYPE_ALIASES,
    DTYPE_CHOICES,
    QUANTIZATIONS,
    SERVED_WAITING_PER_SEQ,
)
from parashift.engine.args import EngineArgs

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str, flag: str) -> int:
    """'2GiB', '512MiB', '1.5G', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise typer.BadParameter(f"{text!r} is not a size like 2GiB or 512MiB", param_hint=flag)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_gib(text: str, flag: str) -> int:
    """'4' (GiB, as vLLM's --kv-offloading-size) or '512MiB' -> bytes."""
    try:
        return int(float(text) * 2**30)
    except ValueError:
        return parse_size(text, flag)


def parse_counts(text: str, flag: str, example: str = "1,4,32") -> list[int]:
    """'1,4,32' -> [1, 4, 32]: whole numbers >= 1 joined by commas."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a list like {example}",
                                 param_hint=flag) from None
    if min(values) < 1:
        raise typer.BadParameter("every value must be >= 1", param_hint=flag)
    return values


def setup_logging() -> None:
    logging.basicConfig(level=env.log_level(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


ModelArg = Annotated[str | None, typer.Argument(
    help="Hugging Face folder or .gguf file; default: the embedded SmolLM2-135M-Instruct")]

# vLLM's engine flags, which every command that starts an engine takes: EngineArgs field ->
# its typer option. The defaults are EngineArgs' own (engine/args.py), written nowhere else.
_ENGINE_FLAGS: dict[str, Any] = {
    "dtype": Annotated[Literal[(*DTYPE_CHOICES, *DTYPE_ALIASES)], typer.Option(
        help="the weights' dtype (auto: the engine's choice for the checkpoint and device)")],
    "quantization": Annotated[Literal[QUANTIZATIONS] | None, typer.Option(
        "--quantization", "-q", help="CPU: weight-only int8 (per channel) or int4 (groups of "
        "32) for the decoder layers' linear weights")],
    "max_model_len": Annotated[int | None, typer.Option("--max-model-len")],
    "max_num_seqs": Annotated[int, typer.Option("--max-num-seqs")],
    "max_num_batched_tokens": Annotated[int | None, typer.Option("--max-num-batched-tokens")],
    "max_waiting_requests": Annotated[int | None, typer.Option(
        "--max-waiting-requests", help="per engine, requests held while asleep included: "
        f"past it, new requests get HTTP 429 [default for `run`: {SERVED_WAITING_PER_SEQ} x "
        "--max-num-seqs; offline: no limit]")],
    **{f"{pool}_{limit}": Annotated[int | None, typer.Option(
        f"--{pool}-{limit.replace('_', '-')}", help=f"prefill/decode pools: the {pool} "
        f"engines' --{limit.replace('_', '-')}")]
       for pool in ("prefill", "decode") for limit in ("max_num_batched_tokens", "max_num_seqs")},
    "prefill_schedule_interval": Annotated[int, typer.Option(
        "--prefill-schedule-interval", help="expert-parallel lockstep groups: the ranks take "
        "new prefill work only on every Nth step of a wave, all on the same steps (off while "
        "a rank cannot admit its waiting requests); 1: every step")],
    "block_size": Annotated[int, typer.Option("--block-size")],
    "kv_cache_memory": Annotated[str | None, typer.Option(
        "--kv-cache-memory", help="KV cache budget on CPU, e.g. 2GiB")],
    "kv_offloading_size": Annotated[str | None, typer.Option(
        "--kv-offloading-size", help="host memory for the node's KV tier, shared by its DP "
        "ranks: GiB (vLLM's unit) or a size like 512MiB; blocks evicted from the KV cache "
        "load from it instead of being recomputed")],
    "kv_offloading_decode": Annotated[bool, typer.Option(
        "--kv-offloading-decode/--no-kv-offloading-decode", help="the host tier also stores "
        "the full blocks of generated tokens (a chat's next turn finds its last answer), not "
        "only prompt blocks")],
    "kv_offloading_backend": Annotated[Literal["native"], typer.Option(
        "--kv-offloading-backend", help="the KV tiers' implementation")],
    "kv_disk_dir": Annotated[str | None, typer.Option(
        "--kv-disk-dir", help="a disk KV tier in this folder (mode 0700, yours), warm across "
        "restarts; needs --kv-offloading-size and --kv-disk-size")],
    "kv_disk_size": Annotated[str | None, typer.Option(
        "--kv-disk-size", help="the disk KV tier's size: GiB or a size like 20GiB")],
    "gpu_memory_utilization": Annotated[float, typer.Option("--gpu-memory-utilization")],
    "enable_prefix_caching": Annotated[bool, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching")],
    "device": Annotated[Literal["cpu", "cuda"] | None, typer.Option(
        help="where the model runs (default: cuda when a GPU is visible, else cpu)")],
    "num_threads": Annotated[int | None, typer.Option("--threads", help="CPU threads for torch")],
    "attention_backend": Annotated[Literal[ATTENTION_BACKENDS], typer.Option(
        "--attention-backend",
        help="auto: Triton kernels on CUDA, the compiled CPU kernels (cpu) on CPU")],
    "cpu_kernels": Annotated[str, typer.Option(
        "--cpu-kernels", help="CPU: our compiled kernels built for this CPU (native), for "
        "another (a gcc -march, e.g. haswell), or off (torch ops only)")],
    "gemm_paths": Annotated[str | None, typer.Option(
        "--gemm-paths", help="CPU: the GEMM paths the load-time timing chooses among, e.g. "
        "linear,onednn (default: linear, onednn, own-bf16)")],
    "enforce_eager": Annotated[bool, typer.Option(
        "--enforce-eager", help="CUDA: decode without CUDA graphs")],
    "deterministic": Annotated[bool, typer.Option(
        "--deterministic", help="CPU: a request's logits and tokens bitwise the same whatever "
        "it shares a step with, however its prompt is chunked or cached "
        "(docs/reproducibility.md; slower prefill)")],
    "async_scheduling": Annotated[bool | None, typer.Option(
        "--async-scheduling/--no-async-scheduling", help="schedule step N+1 while step N "
        "runs (default: on with CUDA, off on CPU, where it measured no faster)")],
    "disable_shm_all_reduce": Annotated[bool, typer.Option(
        "--disable-shm-all-reduce",
        help="CPU tensor parallel: all-reduce through gloo only, not shared memory")],
    "while_asleep": Annotated[Literal["reject", "wait"], typer.Option(
        "--while-asleep", help="a request to a sleeping server: 503, or wait for /wake_up")],
    "strategy": Annotated[str | None, typer.Option(
        help="parallel layout: axes joined by x, e.g. dp2, tp2, dp4xtp2; p1xd1: a prefill "
        "and a decode pool")],
    "data_parallel_size": Annotated[int | None, typer.Option("--data-parallel-size", "-dp")],
    "tensor_parallel_size": Annotated[int | None, typer.Option(
        "--tensor-parallel-size", "-tp")],
    "pipeline_parallel_size": Annotated[int | None, typer.Option(
        "--pipeline-parallel-size", "-pp")],
    "pp_layer_partition": Annotated[str | None, typer.Option(
        "--pp-layer-partition", help="layers per pipeline stage, e.g. 10,10,10 (default: even, "
        "the extra layers on the first stages)")],
    "enable_expert_parallel": Annotated[bool, typer.Option("--enable-expert-parallel")],
}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}


def engine_options(command: Callable[..., Any] | None = None, *,
                   flags: Iterable[str] | None = None,
                   replace: Mapping[str, Any] | None = None) -> Any:
    """Give a typer command the MODEL argument (first) and the engine flags (last). The command
    declares `engine_args` instead and receives them as one EngineArgs (the flags it does not
    take at their defaults). `flags`: only these of the table (`plan` takes those a dry run
    reads); `replace`: another type for MODEL or a flag (`plan`: its presets, its what-if fp8).
    Used bare (`@engine_options`) or with these (`@engine_options(flags=...)`)."""
    if command is None:
        return functools.partial(engine_options, flags=flags, replace=replace)
    replace = replace or {}
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    # Annotations are strings here (PEP 563); `engine_args` names a type only imported for
    # type checkers, so it is left out before the others are evaluated, as typer needs them.
    own = [p.replace(annotation=eval(p.annotation, command.__globals__))  # nosec B307
           if isinstance(p.annotation, str) else p
           for p in inspect.signature(command).parameters.values() if p.name != "engine_args"]
    engine = [inspect.Parameter("model", kind, annotation=replace.get("model", ModelArg),
                                default=None)]
    engine += [inspect.Parameter(name, kind, annotation=replace.get(name, _ENGINE_FLAGS[name]),
                                 default=_DEFAULTS[name])
               for name in (_ENGINE_FLAGS if flags is None else flags)]

    @functools.wraps(command)
    def with_engine_args(**kwargs: Any) -> Any:
        values = {p.name: kwargs.pop(p.name) for p in engine}
        if values.get("kv_cache_memory") is not None:
            values["kv_cache_memory"] = parse_size(values["kv_cache_memory"], "--kv-cache-memory")
        for name in ("kv_offloading_size", "kv_disk_size"):
            if values.get(name) is not None:
                values[name] = parse_gib(values[name], "--" + name.replace("_", "-"))
        return command(engine_args=EngineArgs(**values), **kwargs)

    params = [engine[0], *own, *engine[1:]]
    with_engine_args.__signature__ = inspect.Signature(params)  # what typer reads
    with_engine_args.__annotations__ = {p.name: p.annotation for p in params}
    return with_engine_args

"""Command-line pieces shared by `parashift run`, `generate` and `bench`: vLLM's engine flags
as typer option types, and `engine_options`, which gives a command all of them at once."""

from __future__ import annotations

import functools
import inspect
import logging
import re
import sys
from collections.abc import Callable
from typing import Annotated, Any

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


ModelArg = Annotated[str | None, typer.Argument(
    help="Hugging Face folder or .gguf file; default: the embedded SmolLM2-135M-Instruct")]

# vLLM's engine flags, which every command that starts an engine takes:
# (EngineArgs field, typer type, default).
_ENGINE_FLAGS: list[tuple[str, Any, Any]] = [
    ("dtype", Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")], "auto"),
    ("max_model_len", Annotated[int | None, typer.Option("--max-model-len")], None),
    ("max_num_seqs", Annotated[int, typer.Option("--max-num-seqs")], 128),
    ("max_num_batched_tokens", Annotated[int | None, typer.Option("--max-num-batched-tokens")],
     None),
    ("block_size", Annotated[int, typer.Option("--block-size")], 16),
    ("kv_cache_memory", Annotated[str | None, typer.Option(
        "--kv-cache-memory", help="KV cache budget on CPU, e.g. 2GiB")], None),
    ("gpu_memory_utilization", Annotated[float, typer.Option("--gpu-memory-utilization")], 0.9),
    ("enable_prefix_caching", Annotated[bool, typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching")], True),
    ("num_threads", Annotated[int | None, typer.Option(
        "--threads", help="CPU threads for torch")], None),
    ("strategy", Annotated[str | None, typer.Option(
        help="parallel layout: axes joined by x, e.g. dp2, tp2, dp4xtp2")], None),
    ("data_parallel_size", Annotated[int | None, typer.Option("--data-parallel-size", "-dp")],
     None),
    ("tensor_parallel_size", Annotated[int | None, typer.Option(
        "--tensor-parallel-size", "-tp")], None),
    ("pipeline_parallel_size", Annotated[int | None, typer.Option(
        "--pipeline-parallel-size", "-pp")], None),
    ("enable_expert_parallel", Annotated[bool, typer.Option("--enable-expert-parallel")], False),
]


def engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give a typer command the MODEL argument (first) and the engine flags (last). The command
    declares `engine_args` instead and receives them as one EngineArgs."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    # Annotations are strings here (PEP 563); `engine_args` names a type only imported for
    # type checkers, so it is left out before the others are evaluated, as typer needs them.
    own = [p.replace(annotation=eval(p.annotation, command.__globals__))
           if isinstance(p.annotation, str) else p
           for p in inspect.signature(command).parameters.values() if p.name != "engine_args"]
    engine = [inspect.Parameter("model", kind, annotation=ModelArg, default=None)]
    engine += [inspect.Parameter(name, kind, annotation=type_, default=default)
               for name, type_, default in _ENGINE_FLAGS]

    @functools.wraps(command)
    def with_engine_args(**kwargs: Any) -> Any:
        from parashift.engine.args import EngineArgs

        values = {p.name: kwargs.pop(p.name) for p in engine}
        if values["kv_cache_memory"] is not None:
            values["kv_cache_memory"] = parse_size(values["kv_cache_memory"], "--kv-cache-memory")
        return command(engine_args=EngineArgs(**values), **kwargs)

    params = [engine[0], *own, *engine[1:]]
    with_engine_args.__signature__ = inspect.Signature(params)  # what typer reads
    with_engine_args.__annotations__ = {p.name: p.annotation for p in params}
    return with_engine_args

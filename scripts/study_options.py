"""Options and workloads shared by the studies in scripts/ (each starts the servers or engines
it compares, with a fixed layout, and takes these instead of every engine flag)."""

from __future__ import annotations

import shlex
from typing import Annotated, Literal

import typer

from parashift.defaults import DTYPE_CHOICES

InputLenRange = Annotated[str, typer.Option("--input-len-range", help="A:B")]
OutputLenRange = Annotated[str, typer.Option("--output-len-range", help="A:B")]
Dtype = Annotated[Literal[DTYPE_CHOICES], typer.Option(help="the weights' dtype")]
ServerArgs = Annotated[str, typer.Option(
    "--server-args", help="extra `parashift run` flags, e.g. '--max-model-len 512'")]
Repeat = Annotated[int, typer.Option(help="timed runs of every configuration; medians count")]


def server_args(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:
        raise ValueError(f"--server-args {text!r}: {e}") from None


def served_workload(model: str | None, num_prompts: int, input_range: str, output_range: str,
                    seed: int, extra: str):
    """For the commands that start servers: random token-id prompts below the model's
    vocabulary (lengths uniform in A:B), the vocabulary size and the extra `run` flags; a bad
    flag ends the command naming it."""
    from parashift.cli_options import fail

    try:
        extra_args = server_args(extra)  # before the model is resolved: a bad flag fails at once
        requests, vocab = random_workload(model, num_prompts, input_range, output_range, seed)
        return requests, vocab, extra_args
    except ValueError as e:
        fail(str(e))


def random_workload(model: str | None, num_prompts: int, input_range: str, output_range: str,
                    seed: int):
    """Random token-id prompts below the model's vocabulary, lengths uniform in A:B."""
    from parashift.bench.datasets import parse_range, random_requests
    from parashift.models.loader import load_hf_config, resolve_model_path

    ins = parse_range(input_range, "--input-len-range")
    outs = parse_range(output_range, "--output-len-range")
    vocab_size = load_hf_config(resolve_model_path(model)).vocab_size
    return random_requests(num_prompts, ins, outs, vocab_size, seed), vocab_size

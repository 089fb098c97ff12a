"""Options and the workload shared by every `parashift bench` command."""

from __future__ import annotations

import shlex
from typing import Annotated, Literal

import typer

from parashift.defaults import DTYPE_CHOICES

NumPrompts = Annotated[int, typer.Option("--num-prompts")]
InputLen = Annotated[int | None, typer.Option("--input-len")]
OutputLen = Annotated[int | None, typer.Option("--output-len")]
InputRange = Annotated[str | None, typer.Option("--input-len-range", help="A:B")]
OutputRange = Annotated[str | None, typer.Option("--output-len-range", help="A:B")]
# The same, for the commands whose workload always has ranges (each with its own default).
InputLenRange = Annotated[str, typer.Option("--input-len-range", help="A:B")]
OutputLenRange = Annotated[str, typer.Option("--output-len-range", help="A:B")]
Dataset = Annotated[str | None, typer.Option(
    help=".jsonl (prompt or prompt_len, output_len) or ShareGPT .json/.jsonl")]
Seed = Annotated[int, typer.Option(help="seeds the workload and the arrivals")]
SaveJson = Annotated[str | None, typer.Option("--save-json", help="write everything here")]
Plot = Annotated[str | None, typer.Option(help="write a PNG here")]
# The commands that start their own `parashift run` servers (dp-scaling, serving-vs-offline,
# backends) or engines with a fixed layout (tp) take these instead of every engine flag.
Dtype = Annotated[Literal[DTYPE_CHOICES], typer.Option(help="the weights' dtype")]
ServerArgs = Annotated[str, typer.Option(
    "--server-args", help="extra `parashift run` flags, e.g. '--max-model-len 512'")]
Repeat = Annotated[int, typer.Option(help="timed runs of every configuration; medians count")]
Sampling = Annotated[str, typer.Option(
    "--sampling", help="every request's sampling, e.g. 'temperature=0.8,top_p=0.9' (fields: "
                       "temperature, top_p, top_k, min_p, seed, presence_penalty, "
                       "frequency_penalty, repetition_penalty; temperature 1 unless given); "
                       "empty: greedy")]

_SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                    "seed": int, "presence_penalty": float, "frequency_penalty": float,
                    "repetition_penalty": float}


def sampling_fields(text: str) -> dict[str, float | int]:
    """--sampling 'temperature=0.8,top_k=50' -> the fields, as SamplingParams checks them;
    '' -> greedy (temperature 0). Raises ValueError naming the bad item."""
    from parashift.types.sampling_params import SamplingParams

    fields: dict[str, float | int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = (part.strip() for part in item.partition("="))
        if not sep or name not in _SAMPLING_FIELDS:
            raise ValueError(f"--sampling {item!r}: expected NAME=VALUE, NAME one of "
                             f"{', '.join(_SAMPLING_FIELDS)}")
        try:
            fields[name] = _SAMPLING_FIELDS[name](value)
        except ValueError:
            raise ValueError(f"--sampling {item!r}: {value!r} is not "
                             f"{'an integer' if _SAMPLING_FIELDS[name] is int else 'a number'}"
                             ) from None
    if not fields:
        fields["temperature"] = 0.0
    try:
        SamplingParams(**fields)
    except ValueError as e:
        raise ValueError(f"--sampling: {e}") from None
    return fields


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


def workload(num_prompts, input_len, output_len, input_range, output_range, dataset,
             seed, tokenizer, vocab_size):
    from parashift.bench.datasets import load_dataset, parse_range, random_requests

    if dataset is not None:
        if input_len or input_range:
            raise ValueError("--dataset sets the prompts: drop --input-len/--input-len-range")
        return load_dataset(  # nosec B615
            dataset, num_prompts, tokenizer, vocab_size, seed, output_len)
    if input_len is not None and input_range is not None:
        raise ValueError("give --input-len or --input-len-range, not both")
    if output_len is not None and output_range is not None:
        raise ValueError("give --output-len or --output-len-range, not both")
    ins = parse_range(input_range, "--input-len-range") if input_range else (
        (input_len, input_len) if input_len else (128, 128))
    outs = parse_range(output_range, "--output-len-range") if output_range else (
        (output_len, output_len) if output_len else (128, 128))
    if min(ins + outs) < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    return random_requests(num_prompts, ins, outs, vocab_size, seed)

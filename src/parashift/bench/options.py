"""Options and the workload shared by every `parashift bench` command."""

from __future__ import annotations

from typing import Annotated

import typer

NumPrompts = Annotated[int, typer.Option("--num-prompts")]
InputLen = Annotated[int | None, typer.Option("--input-len")]
OutputLen = Annotated[int | None, typer.Option("--output-len")]
InputRange = Annotated[str | None, typer.Option("--input-len-range", help="A:B")]
OutputRange = Annotated[str | None, typer.Option("--output-len-range", help="A:B")]
Dataset = Annotated[str | None, typer.Option(
    help=".jsonl (prompt or prompt_len, output_len) or ShareGPT .json/.jsonl; for bench "
         "serve also multi-turn: chat users, sized by --multi-turn-* and --output-len")]
MultiTurnUsers = Annotated[int, typer.Option(
    "--multi-turn-users", help="--dataset multi-turn: users, each holding one conversation")]
MultiTurnRounds = Annotated[int, typer.Option(
    "--multi-turn-rounds", help="--dataset multi-turn: requests per user, each sent when the "
                                "one before has finished and carrying the conversation so far")]
MultiTurnSystemLen = Annotated[int, typer.Option(
    "--multi-turn-system-len", help="--dataset multi-turn: tokens of the system prompt that "
                                    "every user's conversation starts with")]
MultiTurnHistoryLen = Annotated[int, typer.Option(
    "--multi-turn-history-len", help="--dataset multi-turn: tokens of each user's own history "
                                     "between the system prompt and the first round")]
MultiTurnQuestionLen = Annotated[int, typer.Option(
    "--multi-turn-question-len", help="--dataset multi-turn: tokens of each new question")]
Seed = Annotated[int, typer.Option(help="seeds the workload and the arrivals")]
SaveJson = Annotated[str | None, typer.Option("--save-json", help="write everything here")]
Plot = Annotated[str | None, typer.Option(help="write a PNG here")]
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

"""Benchmark workloads: random token-id prompts with fixed or ranged lengths, or a dataset
file -- JSONL with prompts / lengths, or ShareGPT conversations (JSON or JSONL)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class BenchRequest:
    prompt: list[int] | str  # token ids, or text for the server / engine to tokenize
    prompt_len: int
    output_len: int


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """"128" -> (128, 128); "32:256" -> (32, 256)."""
    lo, sep, hi = text.partition(":")
    try:
        pair = (int(lo), int(hi) if sep else int(lo))
    except ValueError:
        raise ValueError(f"{flag} {text!r}: use N or A:B with whole numbers") from None
    if pair[0] < 1 or pair[0] > pair[1]:
        raise ValueError(f"{flag} {text!r}: need 1 <= A <= B")
    return pair


def random_requests(n: int, input_lens: tuple[int, int], output_lens: tuple[int, int],
                    vocab_size: int, seed: int) -> list[BenchRequest]:
    if n < 1:
        raise ValueError("--num-prompts must be >= 1")
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_lens[0], input_lens[1] + 1, size=n)
    outs = rng.integers(output_lens[0], output_lens[1] + 1, size=n)
    lo, hi = (100, vocab_size - 100) if vocab_size > 300 else (0, vocab_size)  # skip specials
    return [BenchRequest(rng.integers(lo, hi, size=int(i)).tolist(), int(i), int(o))
            for i, o in zip(ins, outs, strict=True)]


def load_dataset(path: str, n: int, tokenizer: Any, vocab_size: int, seed: int,
                 output_len: int | None = None) -> list[BenchRequest]:
    """Rows of a JSONL file (`prompt` text or ids, or `prompt_len`; `output_len`) or ShareGPT
    (`conversations`: the first human turn is the prompt, the reply's length the output).
    `output_len` overrides the file's. The first `n` usable rows, in file order."""
    if not os.path.isfile(path):
        raise ValueError(f"--dataset {path}: no such file")
    rows = _read_rows(path)
    rng = np.random.default_rng(seed)
    out: list[BenchRequest] = []
    for where, row in rows:
        request = _request(row, where, tokenizer, vocab_size, rng, output_len)
        if request is not None:
            out.append(request)
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"--dataset {path}: no usable rows")
    return out


def _read_rows(path: str) -> list[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):  # ShareGPT's usual form: one JSON list
        try:
            return [(f"{path} item {i}", row) for i, row in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            raise ValueError(f"--dataset {path}: not valid JSON ({e})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"--dataset {path}: line {number} is not JSON ({e.msg})") from None
    return rows


def _request(row: Any, where: str, tokenizer: Any, vocab_size: int,
             rng: np.random.Generator, output_len: int | None) -> BenchRequest | None:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object")
    if "conversations" in row:  # ShareGPT
        turns = row["conversations"]
        if len(turns) < 2:
            return None  # nothing to answer
        prompt, reply = turns[0].get("value", ""), turns[1].get("value", "")
        prompt_len = len(tokenizer.encode(prompt))
        want = output_len or len(tokenizer.encode(reply))
        if prompt_len < 1 or want < 1:
            return None
        return BenchRequest(prompt, prompt_len, want)
    want = output_len or row.get("output_len")
    if not isinstance(want, int) or want < 1:
        raise ValueError(f"{where}: needs an integer output_len >= 1 (or pass --output-len)")
    if "prompt" in row:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return BenchRequest(prompt, len(tokenizer.encode(prompt)), want)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return BenchRequest(prompt, len(prompt), want)
        raise ValueError(f"{where}: prompt must be text or a list of token ids")
    length = row.get("prompt_len")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"{where}: needs a prompt, or an integer prompt_len >= 1")
    lo, hi = (100, vocab_size - 100) if vocab_size > 300 else (0, vocab_size)
    return BenchRequest(rng.integers(lo, hi, size=length).tolist(), length, want)

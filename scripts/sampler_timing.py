"""The sampler alone, as the model runner calls it each step: building the step's sampling
metadata from the running requests, then sampling. Batch 32 x 49,152 (SmolLM2's vocabulary) by
default, on the torch threads given, every mode of `peers/serve_sampling.sh` plus combinations,
on bf16 logits (what the LM head returns under --dtype auto on a bf16 CPU).

Logits: "flat" is randn x 3, so that top-p's nucleus holds thousands of tokens (the sampler's
hard case); "peaked" follows a Zipf law over a shuffled vocabulary, as a language model's do.

    python scripts/sampler_timing.py [--rows 32] [--vocab 49152] [--threads 2] [--repeat 200]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch

from parashift.executor.input_batch import InputBatch
from parashift.executor.sampling_inputs import sampling_metadata
from parashift.layers.sampler import Sampler
from parashift.types.outputs import NewRequestData
from parashift.types.sampling_params import SamplingParams

MODES = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0": {"temperature": 1.0},
    "top-p 0.9 (t 0.8)": {"temperature": 0.8, "top_p": 0.9},
    "top-k 50 (t 0.8)": {"temperature": 0.8, "top_k": 50},
    "min-p 0.05 (t 0.9)": {"temperature": 0.9, "min_p": 0.05},
    "penalties (t 0.7, rep 1.1, pres 0.5)": {"temperature": 0.7, "repetition_penalty": 1.1,
                                             "presence_penalty": 0.5},
    "top-k 50 + top-p 0.9 + min-p 0.05": {"temperature": 0.8, "top_k": 50, "top_p": 0.9,
                                          "min_p": 0.05},
    "seeded top-p 0.9 + frequency 0.3": {"temperature": 0.8, "top_p": 0.9, "seed": 1,
                                         "frequency_penalty": 0.3},
}


def logits_for(kind: str, rows: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "flat":
        return (torch.randn(rows, vocab, generator=g) * 3).bfloat16()
    ranks = torch.stack([torch.randperm(vocab, generator=g) for _ in range(rows)]) + 1
    return (-1.1 * ranks.float().log() * 2 + torch.randn(rows, vocab, generator=g) * 0.1
            ).bfloat16()


def batch_for(fields: dict, rows: int, vocab: int) -> InputBatch:
    """Requests 16 prompt tokens + 256 outputs in, as late in serve_sampling's run: the model
    runner's input batch holding them."""
    g = torch.Generator().manual_seed(1)
    batch = InputBatch(max_model_len=512, block_size=16, max_num_reqs=rows)
    for i in range(rows):
        params = SamplingParams(max_tokens=512, **fields)
        if params.seed is not None:
            params = SamplingParams(max_tokens=512, **{**fields, "seed": fields["seed"] + i})
        tokens = torch.randint(0, vocab, (272,), generator=g).tolist()
        batch.add(NewRequestData(f"r{i}", tokens, 16, params, [], 272))
    return batch


def time_mode(logits: torch.Tensor, batch: InputBatch, repeat: int) -> list[float]:
    sampler = Sampler()
    vocab, cpu = logits.shape[-1], torch.device("cpu")
    rows = np.arange(batch.num_reqs)
    times = []
    for _ in range(repeat + 5):
        start = time.perf_counter()
        sampler(logits, sampling_metadata(batch, rows, vocab, cpu))
        times.append(time.perf_counter() - start)
    return times[5:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, "
          f"{args.rows} rows x {args.vocab} tokens, ms per step (min / median of "
          f"{args.repeat})")
    print(f"{'mode':40s} {'flat':>15s} {'peaked':>15s}")
    for name, fields in MODES.items():
        batch = batch_for(fields, args.rows, args.vocab)
        cells = []
        for kind in ("flat", "peaked"):
            times = time_mode(logits_for(kind, args.rows, args.vocab), batch, args.repeat)
            cells.append(f"{min(times) * 1e3:6.3f} / {statistics.median(times) * 1e3:6.3f}")
        print(f"{name:40s} {cells[0]:>15s} {cells[1]:>15s}", flush=True)


if __name__ == "__main__":
    main()

"""The Hugging Face baseline of `parashift bench throughput --baseline hf`: the same requests
through transformers' `generate`, greedy, in static left-padded batches. Each batch generates
as many tokens as its longest request asks for; only the requested tokens count."""

from __future__ import annotations

import time
from typing import Any

import torch
from tqdm import tqdm

from parashift.bench.datasets import BenchRequest


def generate_batch(model: Any, tok: Any, prompts: list[list[int]], out_lens: list[int],
                   device: torch.device) -> list[list[int]]:
    """Greedy outputs of one static batch, each cut to its requested length."""
    enc = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    input_ids = enc["input_ids"].to(device)
    n = max(out_lens)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=enc["attention_mask"].to(device),
                             do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=tok.pad_token_id, temperature=None, top_p=None,
                             top_k=None)
    new = out[:, input_ids.shape[1]:].tolist()
    return [row[:k] for row, k in zip(new, out_lens, strict=True)]


def run_hf(folder: str, requests: list[BenchRequest], dtype: torch.dtype, device: torch.device,
           batch_size: int, progress: bool = True, repeat: int = 1
           ) -> tuple[list[float], list[list[int]]]:
    """Seconds to generate every request, per timed run (after a warm-up batch), and the last
    run's output token ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, padding_side="left")  # nosec B615
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)  # nosec B615
    model = model.to(device).eval()
    prompts = [r.prompt if isinstance(r.prompt, list) else tok.encode(r.prompt)
               for r in requests]
    generate_batch(model, tok, [prompts[0][:16]], [2], device)  # warm-up
    times, token_ids = [], []
    for run in range(repeat):
        token_ids = []
        start = time.perf_counter()
        batches = range(0, len(prompts), batch_size)
        desc = "transformers" if repeat == 1 else f"transformers {run + 1}/{repeat}"
        for i in tqdm(batches, desc=desc, unit="batch", disable=not progress):
            token_ids += generate_batch(model, tok, prompts[i:i + batch_size],
                                        [r.output_len for r in requests[i:i + batch_size]],
                                        device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times, token_ids

"""Decode steps replayed from CUDA graphs (GPU, Triton attention backend; `--enforce-eager`
turns them off).

A decode-only step of n requests runs the graph captured for the smallest capture size >= n:
its inputs (token ids, positions, slot mapping, block table, context lengths) are copied into
the static buffers the graph was captured on, the rows past n padded so that they write no
KV (slot -1) and attend to nothing (context 0). A larger batch, or a step with a prefill,
runs eagerly. One memory pool serves every size (captured largest first)."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn

from parashift.layers.attention.backend import AttentionStepInputs
from parashift.layers.attention.triton_backend import TritonAttentionMetadata

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: the fixed ladder up to max_num_seqs, and max_num_seqs."""
    sizes = [s for s in CAPTURE_SIZES if s < max_num_seqs]
    return sizes + [max_num_seqs]


def padded_size(sizes: list[int], num_seqs: int) -> int | None:
    """The captured size a batch of num_seqs runs in; None past the largest."""
    return next((s for s in sizes if s >= num_seqs), None)


class DecodeGraphs:
    def __init__(self, model: nn.Module, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device):
        self.model = model
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        n, max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_table = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.sliding_window = getattr(model, "sliding_window", None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, size: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(
            self.slot_mapping[:size], size, self.block_table[:size], self.seq_lens[:size],
            self.max_model_len, None, None, None, 0, self.sliding_window)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):  # the largest first: it sizes the shared pool
            metadata = self._metadata(size)
            args = (self.input_ids[:size], self.positions[:size], metadata)
            self.model(*args)  # compiles the kernels for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*args)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s",
                    ",".join(map(str, self.sizes)), time.perf_counter() - start)

    def can_run(self, step: AttentionStepInputs) -> bool:
        num_seqs = len(step.seq_lens)
        return (step.num_decodes == num_seqs and padded_size(self.sizes, num_seqs) is not None
                and step.block_table.shape[1] <= self.block_table.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            step: AttentionStepInputs) -> torch.Tensor:
        """[n] decode tokens -> [n, hidden] final hidden states, through the graph."""
        n = input_ids.shape[0]
        size = padded_size(self.sizes, n)
        assert size is not None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(step.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        width = step.block_table.shape[1]
        table = torch.from_numpy(np.ascontiguousarray(step.block_table, dtype=np.int32))
        self.block_table[:n, :width].copy_(table, non_blocking=True)
        lens = torch.from_numpy(np.ascontiguousarray(step.seq_lens, dtype=np.int32))
        self.seq_lens[:n].copy_(lens, non_blocking=True)
        self.seq_lens[n:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:n]

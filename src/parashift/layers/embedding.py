"""Vocabulary-parallel embedding and LM head: each tensor-parallel rank holds a contiguous
slice of the (padded) vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parashift.distributed.parallel_context import ParallelContext
from parashift.layers.gemm import Gemm
from parashift.layers.weights import WeightSource


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 parallel: ParallelContext):
        super().__init__()
        self.tp = parallel.tp
        self.vocab_size = vocab_size
        self.dtype = dtype
        shard = parallel.shard
        per_rank = -(-vocab_size // shard.tp_size)  # padded so every rank has equal rows
        self.vocab_start = shard.tp_rank * per_rank
        self.vocab_end = min(self.vocab_start + per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, source: WeightSource) -> None:
        rows = self.vocab_end - self.vocab_start
        source.expect(self.vocab_size, param.shape[1])
        param.data[:rows].copy_(source.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # .to(dtype): the weight may be prepacked to float32 when tied to the LM head
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight).to(self.dtype)
        local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        ids = torch.where(local, input_ids - self.vocab_start, 0)
        out = F.embedding(ids, self.weight).to(self.dtype) * local.unsqueeze(-1).to(self.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the rows being sampled. Each rank computes its vocabulary slice; rank 0
    gathers the full row (other ranks get None)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 parallel: ParallelContext, bias: bool = False):
        super().__init__(vocab_size, hidden_size, dtype, parallel)
        if bias:
            raise ValueError("an LM head with bias is not supported")
        self.gemm = Gemm(self.weight)  # a path's own at load (layers/gemm_paths.py)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.gemm = Gemm(self.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # [num_rows, hidden] -> [num_rows, vocab]
        logits = self.gemm(hidden, None)
        logits = self.tp.gather(logits, dim=-1)
        return logits[:, : self.vocab_size] if logits is not None else None

"""Tensor-parallel linear layers. Each owns the sharding of its weights at load time and
behaves as a plain `nn.Linear` when the tensor-parallel group has size 1."""

from __future__ import annotations

import torch
from torch import nn

from parashift.distributed.parallel_context import ParallelContext
from parashift.layers.gemm import Gemm
from parashift.layers.weights import WeightSource


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 parallel: ParallelContext):
        super().__init__()
        self.tp = parallel.tp  # the all-reduces
        self.tp_rank = parallel.shard.tp_rank  # which slice this rank loads
        self.tp_size = parallel.shard.tp_size
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.gemm: Gemm = Gemm(self.weight)  # a path's own at load (layers/gemm_paths.py)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, source: WeightSource) -> None:
        raise NotImplementedError


class ColumnParallelLinear(LinearBase):
    """Y = X A with A split by columns (output features): each rank computes its slice of Y."""

    quantizable = True  # by --quantization (layers/quantization.py says which layers)

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 parallel: ParallelContext):
        tp_size = parallel.shard.tp_size
        if output_size % tp_size:
            raise ValueError(f"output size {output_size} is not divisible by tp={tp_size}")
        super().__init__(input_size, output_size // tp_size, bias, dtype, parallel)

    def weight_loader(self, param: nn.Parameter, source: WeightSource) -> None:
        rows = param.shape[0]
        source.expect(rows * self.tp_size, *param.shape[1:])
        param.data.copy_(source.narrow(0, self.tp_rank * rows, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one weight (gate_up_proj).
    Checkpoint shard `i` lands in rows of block `i` of every rank."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 parallel: ParallelContext):
        tp_size = parallel.shard.tp_size
        for size in output_sizes:
            if size % tp_size:
                raise ValueError(f"output size {size} is not divisible by tp={tp_size}")
        self.shard_sizes = [size // tp_size for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, dtype, parallel)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: int) -> None:
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        source.expect(size * self.tp_size, *param.shape[1:])
        param.data[offset : offset + size].copy_(source.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads. When there are fewer kv heads than ranks, each
    kv head is replicated over tp_size // num_kv_heads consecutive ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype, parallel: ParallelContext):
        tp_size = parallel.shard.tp_size
        if num_heads % tp_size:
            raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by tp={tp_size}")
        if num_kv_heads % tp_size and tp_size % num_kv_heads:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) and tp={tp_size}: one must divide the other"
            )
        self.head_dim = head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias, dtype, parallel)

    def weight_loader(self, param: nn.Parameter, source: WeightSource, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q_size, self.tp_rank
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, rank = kv_size, self.tp_rank // self.kv_replicas
        source.expect(size * (self.tp_size if shard_id == "q" else
                              self.tp_size // self.kv_replicas), *param.shape[1:])
        param.data[offset : offset + size].copy_(source.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Y = X A with A split by rows (input features): each rank multiplies its slice of X and
    the partial sums are all-reduced. The bias is added once, after the reduction."""

    quantizable = True

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 parallel: ParallelContext):
        tp_size = parallel.shard.tp_size
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp={tp_size}")
        super().__init__(input_size // tp_size, output_size, bias, dtype, parallel)

    def weight_loader(self, param: nn.Parameter, source: WeightSource) -> None:
        if param.dim() == 1:  # bias: not sharded
            param.data.copy_(source.expect(*param.shape).load())
            return
        cols = param.shape[1]
        source.expect(param.shape[0], cols * self.tp_size)
        param.data.copy_(source.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.gemm(x, None))
        return y + self.bias if self.bias is not None else y


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (an MoE router): no split, no collective."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype,
                 parallel: ParallelContext):
        super().__init__(input_size, output_size, False, dtype, parallel)

    def weight_loader(self, param: nn.Parameter, source: WeightSource) -> None:
        param.data.copy_(source.expect(*param.shape).load())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, None)

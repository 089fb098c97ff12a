"""Weight-only quantization of the linear layers' weights on CPU (`--quantization`), opt-in.

- int8: one scale per output channel, symmetric (q in [-127, 127]); our own GEMM wherever our
  bf16 one runs (AVX2 and up: the weight widened to bf16 in cache, exactly, on its way to the
  AMX tiles of kernels/cpu/gemm_int8.h or the bf16 GEMM's register blocks), else torch's
  `_weight_int8pack_mm`.
- int4: groups of `INT4_GROUP` input features along each output channel, each with its own
  scale and offset (asymmetric, 16 levels); torch's `_weight_int4pack_mm_for_cpu` reads its
  packed layout. The embedded SmolLM2 comes from a Q4_1 GGUF, blocks of 32 with a scale and a
  minimum: int4 in groups of 32 puts those values back almost exactly.

The kernels take the activations in bfloat16 here, whatever the model's dtype: torch's run
scalar code in float32. Our int8 GEMM streams half the bytes of our bf16 one, a gain where the
rows are bound by memory, not by compute (the figures per CPU: docs/BENCHMARKS.md).

Quantized: the attention and MLP projections of every decoder layer (what a step streams
most). Left as they are: the embedding and the LM head (tied in small models, and where an
error reaches every logit, as vLLM's quantized checkpoints leave them), the routed MoE
experts and their routers (a shared expert is quantized). The weights are quantized per rank
after sharding, so tensor parallel keeps its splits; the scales of a row-parallel shard cover
its own input features."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parashift.defaults import QUANTIZATIONS
from parashift.layers.gemm import Gemm
from parashift.layers.kernel_dispatch import cpu_ops

INT4_GROUP = 32  # input features per int4 group (a Q4_1 block)
INT4_INNER_K_TILES = 2  # the packed layout's k tiling, as torch's CPU kernel reads it
INT4_ROWS = 16  # the packed layout's output features come in blocks of 16
ACTIVATIONS = torch.bfloat16
TINY = torch.finfo(ACTIVATIONS).tiny  # the scale of an all-zero row or group


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight in its quantized layout: `qweight` (int8 [out, in], packed for
    our GEMM where `own_kernel`, or int4 packed by torch) and `scales` (int8: [out]; int4:
    [in / group, out, 2], scale and offset), in bfloat16, the kernels' activation dtype."""

    method: str
    qweight: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    own_kernel: bool = False

    @property
    def nbytes(self) -> int:
        return (self.qweight.numel() * self.qweight.element_size()
                + self.scales.numel() * self.scales.element_size())


class QuantizedGemm(Gemm):
    """The GEMM of a quantized weight; the float weight is gone (a meta tensor)."""

    kind = "quantized"
    reads_plain_weight = False

    def __init__(self, quantized: QuantizedWeight):
        self.quantized = quantized

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return quantized_linear(x, self.quantized, bias)

    @property
    def read_bytes(self) -> int:
        return self.quantized.nbytes


def check_quantization(method: str | None, device: str) -> None:
    """A user's `--quantization` against what runs here (an error naming the flag)."""
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ValueError(f"--quantization {method!r} is unknown; known: "
                         f"{', '.join(QUANTIZATIONS)}")
    if device != "cpu":
        raise ValueError(f"--quantization {method} runs on --device cpu (weight-only CPU "
                         f"kernels), not on {device}")


def own_int8_kernel(in_features: int) -> bool:
    """Whether our int8 GEMM runs here for this width (our bf16 GEMM's CPUs, k even)."""
    ops = cpu_ops()
    return ops is not None and ops.int8_gemm and in_features % 2 == 0


def quantize(weight: torch.Tensor, method: str, own_kernel: bool | None = None
             ) -> QuantizedWeight:
    """`weight` [out, in] -> its quantized layout; int8 packed for our own GEMM where it runs
    here (`own_kernel` None) or where asked."""
    out_features, in_features = weight.shape
    w = weight.float()
    if method == "int8":
        scales = _kept((w.abs().amax(dim=1) / 127).clamp(min=TINY))
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        own = own_int8_kernel(in_features) if own_kernel is None else own_kernel
        if own and not own_int8_kernel(in_features):
            raise RuntimeError(f"our int8 GEMM does not run here for a [{out_features}, "
                               f"{in_features}] weight (it needs our CPU kernels built with "
                               f"a bf16 GEMM, and an even input width)")
        return QuantizedWeight(method, cpu_ops().pack_int8(q) if own else q,
                               scales.to(ACTIVATIONS), out_features, in_features, own)
    if method == "int4":
        if in_features % INT4_GROUP:
            raise ValueError(f"int4 quantization needs input features divisible by "
                             f"{INT4_GROUP}, not {in_features}")
        rows = -(-out_features // INT4_ROWS) * INT4_ROWS  # zero rows pad what the layout needs
        w = torch.cat([w, w.new_zeros(rows - out_features, in_features)])
        groups = w.reshape(rows, in_features // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = _kept(((high - low) / 15).clamp(min=TINY))
        offsets = _kept(low + 8 * scales)  # torch's kernel computes (q - 8) * scale + offset
        low = offsets - 8 * scales
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
        packed = torch._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).reshape(rows, in_features), INT4_INNER_K_TILES)
        scales_and_offsets = torch.stack([scales.t(), offsets.t()], dim=-1).contiguous()
        return QuantizedWeight(method, packed, scales_and_offsets.to(ACTIVATIONS), out_features,
                               in_features)
    raise ValueError(f"unknown quantization {method!r}")


def _kept(values: torch.Tensor) -> torch.Tensor:
    """`values` as the kernels will read them (bf16), in float32: the integers are rounded
    against what is kept."""
    return values.to(ACTIVATIONS).float()


def dequantize(q: QuantizedWeight) -> torch.Tensor:
    """The float32 weight [out, in] that `q` stands for, exactly (for the checks)."""
    if q.method == "int8":
        values = _unpack_int8(q) if q.own_kernel else q.qweight
        return values.float() * q.scales.float()[:, None]
    # torch's packed int4 layout is its own: read back through its kernel, in float32
    eye = torch.eye(q.in_features)
    return torch._weight_int4pack_mm_for_cpu(eye, q.qweight, INT4_GROUP, q.scales.float()
                                             )[:, :q.out_features].t().contiguous()


def _unpack_int8(q: QuantizedWeight) -> torch.Tensor:
    """Our GEMM's packed int8 (kernels/cpu/gemm.cpp's layout) -> [out, in]: tiles of up to 4
    blocks of 16 columns, each k pair's columns side by side."""
    flat, k2 = q.qweight.reshape(-1), q.in_features // 2
    blocks, tiles, start = q.qweight.shape[0], [], 0
    for first in range(0, blocks, 4):
        width = min(4, blocks - first)
        tile = flat[start:start + k2 * width * 32].reshape(k2, width * 16, 2)
        tiles.append(tile.permute(1, 0, 2).reshape(width * 16, 2 * k2))
        start += k2 * width * 32
    return torch.cat(tiles)[:q.out_features]


def quantized_linear(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None
                     ) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype."""
    flat = x.reshape(-1, q.in_features)
    a = flat.to(ACTIVATIONS) if flat.dtype != ACTIVATIONS else flat
    if not a.is_contiguous():
        a = a.contiguous()
    if q.own_kernel:  # the bias added in fp32, before the one rounding
        y = cpu_ops().gemm_int8(a, q.qweight, q.scales, None if bias is None
                                else bias.to(ACTIVATIONS))
        bias = None
    elif q.method == "int8":
        y = torch._weight_int8pack_mm(a, q.qweight, q.scales)
    else:
        y = torch._weight_int4pack_mm_for_cpu(a, q.qweight, INT4_GROUP, q.scales)
        if y.shape[-1] != q.out_features:  # the padding rows
            y = y[:, :q.out_features]
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = y.to(x.dtype) if y.dtype != x.dtype else y
    return y.reshape(*x.shape[:-1], q.out_features)

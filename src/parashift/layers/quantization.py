"""Weight-only quantization of the linear layers' weights on CPU (`--quantization`), opt-in.

- int8: one scale per output channel, symmetric (q in [-127, 127]), torch's
  `_weight_int8pack_mm`.
- int4: groups of `INT4_GROUP` input features along each output channel, each with its own
  scale and offset (asymmetric, 16 levels); torch's `_weight_int4pack_mm_for_cpu` reads its
  packed layout. The embedded SmolLM2 comes from a Q4_1 GGUF, blocks of 32 with a scale and a
  minimum: int4 in groups of 32 puts those values back almost exactly.

Both kernels take the activations in bfloat16 here, whatever the model's dtype: in float32
they ran 35-90x slower (scalar code) on a Xeon with AMX. Measured there, at 32 rows both are
2.5-5x slower than our own bf16 GEMM, at 1 row 1.4-3x faster (docs/BENCHMARKS.md): they serve
memory and single-stream latency, not batched throughput.

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

INT4_GROUP = 32  # input features per int4 group (a Q4_1 block)
INT4_INNER_K_TILES = 2  # the packed layout's k tiling, as torch's CPU kernel reads it
INT4_ROWS = 16  # the packed layout's output features come in blocks of 16
ACTIVATIONS = torch.bfloat16
TINY = torch.finfo(ACTIVATIONS).tiny  # the scale of an all-zero row or group


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight in its quantized layout: `qweight` (int8 [out, in], or int4
    packed by torch) and `scales` (int8: [out]; int4: [in / group, out, 2], scale and offset),
    in bfloat16, the kernels' activation dtype."""

    method: str
    qweight: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return (self.qweight.numel() * self.qweight.element_size()
                + self.scales.numel() * self.scales.element_size())


def check_quantization(method: str | None, device: str) -> None:
    """A user's `--quantization` against what runs here (an error naming the flag)."""
    if method is None:
        return
    if method not in QUANTIZATIONS:
        raise ValueError(f"--quantization {method!r} is unknown; known: "
                         f"{', '.join(QUANTIZATIONS)}")
    if device != "cpu":
        raise ValueError(f"--quantization {method} runs on --device cpu (torch's weight-only "
                         f"kernels there), not on {device}")


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """`weight` [out, in] -> its quantized layout."""
    out_features, in_features = weight.shape
    w = weight.float()
    if method == "int8":
        scales = _kept((w.abs().amax(dim=1) / 127).clamp(min=TINY))
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(method, q, scales.to(ACTIVATIONS), out_features, in_features)
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
        return q.qweight.float() * q.scales.float()[:, None]
    # torch's packed int4 layout is its own: read back through its kernel, in float32
    eye = torch.eye(q.in_features)
    return torch._weight_int4pack_mm_for_cpu(eye, q.qweight, INT4_GROUP, q.scales.float()
                                             )[:, :q.out_features].t().contiguous()


def quantized_linear(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None
                     ) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype."""
    flat = x.reshape(-1, q.in_features)
    a = flat.to(ACTIVATIONS) if flat.dtype != ACTIVATIONS else flat
    if not a.is_contiguous():
        a = a.contiguous()
    if q.method == "int8":
        y = torch._weight_int8pack_mm(a, q.qweight, q.scales)
    else:
        y = torch._weight_int4pack_mm_for_cpu(a, q.qweight, INT4_GROUP, q.scales)
        if y.shape[-1] != q.out_features:  # the padding rows
            y = y[:, :q.out_features]
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = y.to(x.dtype) if y.dtype != x.dtype else y
    return y.reshape(*x.shape[:-1], q.out_features)

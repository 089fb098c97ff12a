"""Weight-only int8 / int4 (layers/quantization.py): the kernels compute with the weight the
format stands for, the format stays within half a quantization step of the weight (int4 puts
Q4_1 blocks back), the engine quantizes exactly the decoder layers' projections and then
matches transformers run on those same weights, and `--quantization` is checked like any flag.
The accuracy against float32 on the real SmolLM2 is tests/bench/test_bench_quantization.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parashift.layers.quantization import (
    INT4_GROUP,
    QuantizedGemm,
    check_quantization,
    dequantize,
    own_int8_kernel,
    quantize,
    quantized_linear,
)

SHAPES = [(96, 64), (160, 576), (64, 1536), (40, 64)]  # SmolLM2's widths; int4 pads 40 to 48


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_multiplies_by_the_dequantized_weight(method, out_features, in_features,
                                                         dtype):
    g = torch.Generator().manual_seed(0)
    q = quantize(torch.randn(out_features, in_features, generator=g) * 0.05, method)
    weight = dequantize(q).double()
    bias = torch.randn(out_features, generator=g).to(dtype)
    for rows in (1, 5, 37):
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        out = QuantizedGemm(q)(x, bias)  # no float weight
        assert out.dtype == dtype and out.shape == (rows, out_features)
        # the kernels take bf16 activations and give bf16 results
        reference = x.bfloat16().double() @ weight.t() + bias.double()
        err = (out.double() - reference).abs().max() / reference.abs().max()
        assert err < 1e-2, (rows, float(err))


def test_our_int8_gemm_and_torchs_hold_the_same_weight():
    """Where our int8 GEMM runs (AMX), its packed layout keeps torch's values exactly, and the
    two kernels agree within the bf16 rounding of their results."""
    if not own_int8_kernel(576):
        pytest.skip("our int8 GEMM does not run on this CPU (it needs AMX)")
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 576, generator=g) * 0.05
    ours, torchs = quantize(weight, "int8"), quantize(weight, "int8", own_kernel=False)
    assert ours.own_kernel and not torchs.own_kernel and ours.nbytes >= torchs.nbytes
    assert torch.equal(dequantize(ours), dequantize(torchs))
    x = torch.randn(33, 576, generator=g).bfloat16()
    torch.testing.assert_close(QuantizedGemm(ours)(x, None), QuantizedGemm(torchs)(x, None),
                               rtol=2**-7, atol=1e-2)


def test_our_int8_gemm_asked_for_where_it_cannot_run_is_a_clear_error():
    with pytest.raises(RuntimeError, match="our int8 GEMM does not run here"):
        quantize(torch.randn(16, 7), "int8", own_kernel=True)  # an odd width, on any CPU


def test_a_3d_input_keeps_its_leading_dimensions():
    q = quantize(torch.randn(32, 64), "int8")
    x = torch.randn(2, 3, 64)
    assert torch.equal(quantized_linear(x, q, None), quantized_linear(x.reshape(6, 64), q, None)
                       .reshape(2, 3, 32))


@pytest.mark.parametrize("method,levels", [("int8", 127), ("int4", 15)])
def test_every_value_is_within_half_a_step(method, levels):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 128, generator=g) * torch.logspace(-3, 0, 64)[:, None]  # row scales
    error = (dequantize(quantize(weight, method)) - weight).abs()
    if method == "int8":  # one step per row: its largest magnitude over 127
        step = weight.abs().amax(1, keepdim=True) / levels
    else:  # one step per group of 32: its range over 15
        groups = weight.reshape(64, -1, INT4_GROUP)
        step = ((groups.amax(-1) - groups.amin(-1)) / levels).repeat_interleave(INT4_GROUP, 1)
    # half a step, and the scales (and int4's offsets) kept in bf16: 2^-8 of the row's range
    slack = 2**-8 * weight.abs().amax(1, keepdim=True)
    assert (error <= step / 2 + slack).all()


def test_int4_puts_q4_1_blocks_back():
    """A Q4_1 block is d * q + m, q in 0..15: where a block uses both ends of its range, groups
    of 32 recover it up to the bf16 rounding of the scale and offset."""
    g = torch.Generator().manual_seed(2)
    d = (torch.rand(48, 4, 1, generator=g) * 0.01 + 1e-3).to(torch.bfloat16).float()
    m = (-8 * d).to(torch.bfloat16).float()  # offsets bf16 keeps exactly with the scales
    q = torch.randint(0, 16, (48, 4, INT4_GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    weight = (d * q + m).reshape(48, 4 * INT4_GROUP)
    assert torch.equal(dequantize(quantize(weight, "int4")), weight)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_zero_rows_stay_zero_and_the_bytes_are_the_formats(method):
    weight = torch.randn(64, 128)
    weight[3] = 0
    q = quantize(weight, method)
    assert torch.equal(dequantize(q)[3], torch.zeros(128))
    # int8: a byte a value and a bf16 scale a row; int4: half a byte, a bf16 scale and offset
    # a group of 32
    assert q.nbytes == (64 * 128 + 64 * 2 if method == "int8" else 64 * 64 + 64 * 4 * 2 * 2)


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(8, 48), "int4")


def test_check_quantization_names_the_flag():
    check_quantization(None, "cuda")
    check_quantization("int8", "cpu")
    with pytest.raises(ValueError, match="--quantization 'int3' is unknown; known: int8, int4"):
        check_quantization("int3", "cpu")
    with pytest.raises(ValueError, match="--quantization int4 runs on --device cpu"):
        check_quantization("int4", "cuda")


def _quantized_reference(folder: str, method: str):
    """transformers' model with every decoder projection replaced by its quantized weight,
    each taking bf16 inputs and giving a bf16 result as the kernels do."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for layer in model.model.layers:
        for linear_layer in layer.modules():
            if isinstance(linear_layer, nn.Linear):
                linear_layer.weight.data = dequantize(quantize(linear_layer.weight.data, method))
                linear_layer.register_forward_pre_hook(
                    lambda _, args: (args[0].bfloat16().float(),))
                linear_layer.register_forward_hook(lambda _, __, out: out.bfloat16().float())
    return model


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_engine_quantizes_the_decoder_projections_and_matches_transformers(
        tiny_model_factory, method):
    from parashift import LLM, SamplingParams

    folder = tiny_model_factory("llama")
    llm = LLM(folder, dtype="float32", quantization=method, kv_cache_memory=8 << 20)
    try:
        model = llm.engine.executor.worker.model
        quantized = [name for name, m in model.named_modules()
                     if isinstance(getattr(m, "gemm", None), QuantizedGemm)]
        assert quantized == [f"layers.{i}.{name}" for i in range(2) for name in (
            "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
        assert all(m.weight.is_meta for name, m in model.named_modules() if name in quantized)
        assert not model.lm_head.weight.is_meta
        prompts = [[5, 9, 100, 42, 7], list(range(60, 93))]
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    reference = _quantized_reference(folder, method)
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs, strict=True):
            completion = out.outputs[0]
            ids = torch.tensor([prompt + completion.token_ids])
            logp = reference(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
            assert completion.token_ids == logp.argmax(-1).tolist()
            for step, top in enumerate(completion.logprobs):
                for token, value in top.items():
                    assert abs(value - float(logp[step, token])) < 2e-2, (step, token)


@pytest.mark.slow
def test_tensor_parallel_ranks_quantize_their_own_shards(tiny_model_factory):
    """tp2: each rank quantizes its slice (a row-parallel slice gets its own scales), and the
    result stays within the quantization's noise of one rank's."""
    from parashift import LLM, SamplingParams

    folder = tiny_model_factory("llama")
    prompts = [[5, 9, 100, 42, 7], list(range(60, 93))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    runs = []
    for strategy in ("tp1", "tp2"):
        llm = LLM(folder, dtype="float32", quantization="int8", kv_cache_memory=8 << 20,
                  strategy=strategy)
        try:
            runs.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.shutdown()
    for one, two in zip(*runs, strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        for a, b in zip(one.outputs[0].logprobs, two.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[t] - b[t]) < 2e-2 for t in a)

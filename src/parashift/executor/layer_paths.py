"""Whether a dense model's decoder layers run fused (executor/fused_cpu_layers.py: every
projection on our own bf16 kernel, one kernel call a layer) or layer by layer with each
projection on the path its own GEMM timing chose (layers/gemm_paths.py), chosen by timing
whole steps, never one GEMM alone: a GEMM that times faster on oneDNN can still make the step
slower, by switching the fused layer off for the whole model (the MLP's oneDNN GEMMs on an
AMX Xeon: docs/BENCHMARKS.md).

The timing runs on a probe: the model's own class with random weights and as many of its
layers as hold STREAM_BYTES of weights (at least two; a whole model's step streams its weights
past the caches), built twice (the per-GEMM mix; our kernel everywhere), each stepped through a
decode step of 32 rows over 384 cached tokens and a prefill chunk of 256 tokens, alternated.
Fused is kept where its decode step is faster and its prefill chunk within 10% of the mix's.
The choice is cached with the GEMM paths, per CPU and layer shape; each path keeps one copy of
a weight, so the bytes `plan` predicts do not depend on it.

Not timed, fused or not as before: a model whose per-GEMM choice already puts every projection
on our kernel, a model the fused layer does not take (MoE experts and tensor parallel, seen
from the model; q/k norms or a head size other than 64 or 128, seen once from the probe and
cached), and any model outside bf16 on a CPU with our kernels."""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from parashift.distributed.parallel_context import ParallelContext
from parashift.executor.fused_cpu_layers import FusedCpuLayers
from parashift.layers.attention.backend import AttentionBackend, AttentionStepInputs
from parashift.layers.gemm import Gemm
from parashift.layers.gemm_paths import (
    LOSS_MARGIN,
    STREAM_BYTES,
    GemmPaths,
    can_own_bf16,
    candidates,
    prepare_gemm_weights,
)
from parashift.layers.kernel_dispatch import cpu_ops

logger = logging.getLogger(__name__)

FUSED, SPLIT = "fused", "per-gemm"
PROBE_VOCAB = 1024  # the probe's embedding: its LM head is never run
DECODE_ROWS = 32
CONTEXT = 384  # cached tokens under each decode row
PREFILL_TOKENS = 256
ROUNDS = 10


def projections(model: nn.Module) -> list[nn.Module]:
    """The decoder layers' projections: the modules `--quantization` and the fused layer take
    (`quantizable`)."""
    return [m for m in model.modules()
            if getattr(m, "quantizable", False) and isinstance(getattr(m, "gemm", None), Gemm)]


def layer_key(model: nn.Module) -> str:
    """The cache key of a model's layer shape: every projection's dtype and shape."""
    shapes = sorted({(str(m.weight.dtype).removeprefix("torch."), *m.weight.shape)
                     for m in projections(model)})
    return "layers:" + ",".join(f"{d}:{o}x{i}" for d, o, i in shapes)


def _may_fuse(model: nn.Module, policy: tuple[str, ...] | None) -> bool:
    layers, ops = getattr(model, "layers", None), cpu_ops()
    if (not layers or not hasattr(layers[0], "parts") or not can_own_bf16()
            or not ops.bf16_attention):
        return False
    if policy is not None and "own-bf16" not in policy:
        return False
    parts = [layer.parts() for layer in layers]
    return (all(p is not None and p.mlp is None and p.attention.qkv_proj.tp_size == 1
                for p in parts)
            and all(m.weight.dtype == torch.bfloat16 for m in projections(model)))


def probe_layers(model: nn.Module) -> int:
    """Layers enough to stream STREAM_BYTES of weights a step, as a whole model's step does."""
    layer = sum(m.weight.numel() * m.weight.element_size() for m in projections(model.layers[0]))
    return max(2, min(len(model.layers), math.ceil(STREAM_BYTES / layer)))


def choose_layer_path(model: nn.Module, backend: AttentionBackend, block_size: int,
                      paths: GemmPaths, policy: tuple[str, ...] | None = None) -> str:
    """FUSED: put every projection of `model` (loaded, not yet prepared) on our kernel, so that
    the fused layer runs; SPLIT: each on its own GEMM's choice."""
    if not _may_fuse(model, policy):
        return SPLIT
    mix = {paths.choose(m.weight.dtype, *m.weight.shape, policy=policy)
           for m in projections(model)}
    if mix == {"own-bf16"}:  # fused already, if the layer takes it
        return SPLIT
    key = layer_key(model)
    known = paths.choices.get(key)
    if known in (FUSED, SPLIT):
        return known
    cached = policy is None or set(candidates(torch.bfloat16)) <= set(policy)
    timings = _time_probes(model, backend, block_size, paths, policy)
    if timings is None:  # the fused layer does not take this model here: not built again
        if cached:
            paths.record(key, SPLIT, {"fused": "not taken"})
        return SPLIT
    (fused_decode, fused_prefill), (split_decode, split_prefill) = timings
    choice = (FUSED if fused_decode < split_decode and LOSS_MARGIN * fused_prefill <= split_prefill
              else SPLIT)
    logger.info("decoder layers %s: a decode step of %d rows %.2f ms fused, %.2f ms per GEMM; "
                "a prefill chunk of %d tokens %.2f ms, %.2f ms (%d-layer probe)", choice,
                DECODE_ROWS, fused_decode * 1e3, split_decode * 1e3, PREFILL_TOKENS,
                fused_prefill * 1e3, split_prefill * 1e3, probe_layers(model))
    if cached:  # (a narrower --gemm-paths policy's pick is not)
        paths.record(key, choice, {"decode": [fused_decode, split_decode],
                                   "prefill": [fused_prefill, split_prefill]})
    return choice


def _probe(model: nn.Module, backend: AttentionBackend, paths: GemmPaths,
           policy: tuple[str, ...] | None, own_layers: bool) -> nn.Module:
    """`model`'s class with `probe_layers` layers, random weights, its projections prepared."""
    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = probe_layers(model)
    cfg.vocab_size = min(cfg.vocab_size, PROBE_VOCAB)
    max_position = CONTEXT + PREFILL_TOKENS
    g = torch.Generator().manual_seed(0)
    probe = type(model)(cfg, model.dtype, backend, max_position, ParallelContext())
    with torch.no_grad():
        for p in probe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    prepare_gemm_weights(probe.layers, torch.device("cpu"), policy=policy, paths=paths,
                         own_layers=own_layers)
    return probe.eval()


def _steps(probe: nn.Module, backend: AttentionBackend, block_size: int
           ) -> tuple[Callable[[], None], Callable[[], None]]:
    """A decode step and a prefill chunk of `probe`, each writing to its own cache blocks."""
    per_row = -(-(CONTEXT + 1) // block_size)
    decode_table = np.arange(DECODE_ROWS * per_row, dtype=np.int32).reshape(DECODE_ROWS, -1)
    prefill_table = (DECODE_ROWS * per_row
                     + np.arange(-(-PREFILL_TOKENS // block_size), dtype=np.int32)[None])
    layer = probe.attention_layers[0]
    shape = (decode_table.size + prefill_table.size, block_size, layer.num_kv_heads,
             layer.head_dim)
    probe.bind_kv_cache([(torch.zeros(shape, dtype=probe.dtype),
                          torch.zeros(shape, dtype=probe.dtype)) for _ in probe.attention_layers])

    def step(table: np.ndarray, starts: np.ndarray, q_lens: np.ndarray) -> Callable[[], None]:
        cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        positions = np.repeat(starts - cu[:-1], q_lens) + np.arange(cu[-1])
        rows = np.repeat(np.arange(len(q_lens)), q_lens)
        slots = table[rows, positions // block_size].astype(np.int64) * block_size + (
            positions % block_size)
        inputs = AttentionStepInputs(
            query_start_loc=cu, seq_lens=starts + q_lens, num_computed_tokens=starts,
            block_table=table, slot_mapping=torch.from_numpy(slots),
            num_decodes=int((q_lens == 1).sum()), block_size=block_size,
            sliding_window=probe.sliding_window, device=torch.device("cpu"))
        ids = torch.from_numpy(positions % probe.config.vocab_size)
        at = torch.from_numpy(positions)
        return lambda: probe(ids, at, backend.build_metadata(inputs))

    decode = step(decode_table, np.full(DECODE_ROWS, CONTEXT), np.ones(DECODE_ROWS, np.int64))
    prefill = step(prefill_table, np.zeros(1, np.int64), np.array([PREFILL_TOKENS]))
    return decode, prefill


def _time_probes(model: nn.Module, backend: AttentionBackend, block_size: int,
                 paths: GemmPaths, policy: tuple[str, ...] | None
                 ) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """((decode, prefill) seconds fused, (decode, prefill) per GEMM), or None where the fused
    layer does not take the probe."""
    steps = []
    for own_layers in (True, False):
        probe = _probe(model, backend, paths, policy, own_layers)
        decode, prefill = _steps(probe, backend, block_size)
        if own_layers:
            probe.fused_layers = FusedCpuLayers.for_model(probe)
            if probe.fused_layers is None:
                return None
        steps.append((decode, prefill))
    best = [[math.inf, math.inf] for _ in steps]
    with torch.inference_mode():
        for variant in steps:  # the first calls' costs out
            for run in variant:
                run()
        for _ in range(ROUNDS):  # alternated: the machine's noise falls on both
            for times, variant in zip(best, steps, strict=True):
                for i, run in enumerate(variant):
                    start = time.perf_counter()
                    run()
                    times[i] = min(times[i], time.perf_counter() - start)
    (fused_decode, fused_prefill), (split_decode, split_prefill) = best
    return (fused_decode, fused_prefill), (split_decode, split_prefill)

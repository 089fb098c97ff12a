"""Fused decoder layers or each projection on its own GEMM's path, chosen by timing whole steps
of a probe (executor/layer_paths.py): the probes really run both ways, the rule keeps fused only
where its decode step wins and its prefill chunk holds, the choice is cached, the model then
runs fused, the bytes kept do not depend on the choice, and what the fused layer cannot take
is never timed."""

from __future__ import annotations

import pytest
import torch

from parashift.distributed.parallel_context import ParallelContext
from parashift.executor import layer_paths
from parashift.executor.fused_cpu_layers import FusedCpuLayers
from parashift.executor.layer_paths import FUSED, SPLIT, choose_layer_path, layer_key, projections
from parashift.layers.attention.backend import get_attention_backend
from parashift.layers.gemm import OwnBf16Gemm
from parashift.layers.gemm_paths import GemmPaths, can_own_bf16, prepare_gemm_weights, weight_bytes
from parashift.layers.kernel_dispatch import cpu_ops
from parashift.models.loader import load_hf_config, load_model

pytestmark = pytest.mark.skipif(
    cpu_ops() is None or not cpu_ops().bf16_attention or not can_own_bf16(),
    reason="the fused layers need our bf16 GEMM and a vector bf16 decode attention")

# (an MLP width of its own: its GEMMs' shapes are no attention GEMM's)
HEAD_64 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=384)
BLOCK = 16


def _load(folder: str, dtype: torch.dtype = torch.bfloat16):
    backend = get_attention_backend("cpu")
    model = load_model(folder, load_hf_config(folder), dtype, torch.device("cpu"), backend, 512,
                       ParallelContext())
    return model, backend


def _mix(model, paths: GemmPaths, mlp: str = "onednn") -> None:
    """The per-GEMM choice, known: our kernel for attention, `mlp` for the MLP."""
    ours = {id(m) for m in projections(model)}
    for name, m in model.named_modules():
        if id(m) in ours:
            key = GemmPaths._key(m.weight.dtype, *m.weight.shape, False)
            paths.choices[key] = mlp if ".mlp." in name else "own-bf16"


def test_a_mix_without_the_fused_layer_is_timed_on_whole_steps_and_cached(
        tiny_model_factory, tmp_path, monkeypatch):
    model, backend = _load(tiny_model_factory("llama", **HEAD_64))
    paths = GemmPaths(str(tmp_path / "paths.json"))
    _mix(model, paths)
    runs = {"fused": 0, "layers": 0}
    fused_call, layer_forward = FusedCpuLayers.__call__, type(model.layers[0]).forward

    def fused(self, *args):
        runs["fused"] += 1
        return fused_call(self, *args)

    def layer(self, *args):
        runs["layers"] += 1
        return layer_forward(self, *args)

    monkeypatch.setattr(FusedCpuLayers, "__call__", fused)
    monkeypatch.setattr(type(model.layers[0]), "forward", layer)
    choice = choose_layer_path(model, backend, BLOCK, paths)
    assert choice in (FUSED, SPLIT)
    assert runs["fused"] > 0 and runs["layers"] > 0  # both probes stepped
    timed = paths.timed[layer_key(model)]
    assert all(t > 0 for t in timed["decode"] + timed["prefill"])
    paths.save()

    again = GemmPaths(paths.path)
    monkeypatch.setattr(layer_paths, "_time_probes", lambda *a: pytest.fail("timed again"))
    assert choose_layer_path(model, backend, BLOCK, again) == choice


def test_fused_layers_keep_the_bytes_of_the_mix(tiny_model_factory, tmp_path):
    folder = tiny_model_factory("llama", **HEAD_64)
    kept = []
    for own_layers in (True, False):
        model, _ = _load(folder)
        paths = GemmPaths(str(tmp_path / "paths.json"))
        _mix(model, paths)
        prepare_gemm_weights(model, torch.device("cpu"), paths=paths, own_layers=own_layers)
        shape = (8, BLOCK, 2, 64)
        model.bind_kv_cache([(torch.zeros(shape, dtype=torch.bfloat16),
                              torch.zeros(shape, dtype=torch.bfloat16)) for _ in model.layers])
        assert (FusedCpuLayers.for_model(model) is not None) == own_layers
        assert all(isinstance(m.gemm, OwnBf16Gemm) for m in projections(model)) == own_layers
        kept.append(weight_bytes(model))
    assert kept[0] == kept[1]


@pytest.mark.parametrize("fused, split, chosen", [
    ((1.0, 1.0), (2.0, 1.0), FUSED),
    ((1.0, 1.05), (2.0, 1.0), FUSED),  # its prefill within 10%
    ((1.0, 1.2), (2.0, 1.0), SPLIT),  # a faster decode, but the prefill loses
    ((2.0, 1.0), (1.0, 1.0), SPLIT),
])
def test_fused_where_its_decode_wins_and_its_prefill_holds(tiny_model_factory, tmp_path,
                                                          monkeypatch, fused, split,
                                                          chosen):
    model, backend = _load(tiny_model_factory("llama", **HEAD_64))
    paths = GemmPaths(str(tmp_path / "paths.json"))
    _mix(model, paths)
    monkeypatch.setattr(layer_paths, "_time_probes", lambda *a: (fused, split))
    assert choose_layer_path(model, backend, BLOCK, paths) == chosen
    assert paths.choices[layer_key(model)] == chosen
    # a narrower --gemm-paths policy's pick is not cached
    narrow = GemmPaths(str(tmp_path / "other.json"))
    _mix(model, narrow)
    choose_layer_path(model, backend, BLOCK, narrow, policy=("linear", "own-bf16"))
    assert layer_key(model) not in narrow.choices


@pytest.mark.parametrize("case", ["already-fused", "policy", "moe", "float32", "head-32"])
def test_what_the_fused_layer_cannot_change_is_not_timed(tiny_model_factory, tmp_path,
                                                         monkeypatch, case):
    arch = "mixtral" if case == "moe" else "llama"
    shape = {} if case == "head-32" else HEAD_64
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    model, backend = _load(tiny_model_factory(arch, **shape), dtype)
    paths = GemmPaths(str(tmp_path / "paths.json"))
    _mix(model, paths, "own-bf16" if case == "already-fused" else "onednn")
    policy = ("linear", "onednn") if case == "policy" else None
    if case != "head-32":  # the probe is built there, and the fused layer refuses it
        monkeypatch.setattr(layer_paths, "_time_probes", lambda *a: pytest.fail("timed"))
    assert choose_layer_path(model, backend, BLOCK, paths, policy) == SPLIT
    kept = {key: value for key, value in paths.choices.items() if key.startswith("layers:")}
    # a probe the fused layer refused is not built again at the next start
    assert kept == ({layer_key(model): SPLIT} if case == "head-32" else {})
    if case == "head-32":
        monkeypatch.setattr(layer_paths, "_time_probes", lambda *a: pytest.fail("built again"))
        assert choose_layer_path(model, backend, BLOCK, paths, policy) == SPLIT


def test_a_served_model_runs_fused_where_the_whole_step_chose_it(tiny_model_factory, tmp_path,
                                                                 monkeypatch):
    """Through the engine: the per-GEMM choice puts the MLP on oneDNN; the step timing says
    fused; every layer then runs in the fused call and the choice is in the cache file."""
    from parashift import LLM, SamplingParams
    from parashift.layers import gemm_paths

    monkeypatch.setenv("PARASHIFT_CACHE_DIR", str(tmp_path))
    choose = gemm_paths.GemmPaths.choose

    def mlp_on_onednn(self, dtype, out_features, in_features, shared=False, policy=None):
        if dtype == torch.bfloat16 and HEAD_64["intermediate_size"] in (
                in_features, out_features // 2):  # the MLP's two GEMMs
            return "onednn"
        return choose(self, dtype, out_features, in_features, shared, policy)

    monkeypatch.setattr(gemm_paths.GemmPaths, "choose", mlp_on_onednn)
    monkeypatch.setattr(layer_paths, "_time_probes", lambda *a: ((1.0, 1.0), (2.0, 1.0)))
    calls = []
    call = FusedCpuLayers.__call__
    monkeypatch.setattr(FusedCpuLayers, "__call__",
                        lambda self, *a: calls.append(1) or call(self, *a))
    llm = LLM(tiny_model_factory("llama", **HEAD_64), dtype="bfloat16", max_model_len=256,
              seed=0)
    try:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=8,
                                                          ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(out[0].outputs[0].token_ids) == 8
    assert calls
    saved = GemmPaths(gemm_paths.cache_file()).choices
    assert FUSED in saved.values()

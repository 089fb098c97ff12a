"""MoE in `plan`: the two ways to hold the experts over a strategy's ranks, replicated (no
ep) or sharded over the dp x tp ranks (ep), with what each costs a rank."""

from __future__ import annotations

from typing import Any

from parashift.plan.shape import ModelShape
from parashift.strategies.expert import expert_range
from parashift.strategies.layout import MeshPoint
from parashift.strategies.spec import StrategySpec


def expert_options(shape: ModelShape, spec: StrategySpec, dtype_bytes: int,
                   quantization: str | None = None) -> dict[str, dict[str, Any]]:
    """MoE: the experts replicated on every rank (no ep) and sharded over the dp x tp ranks
    (ep), for this strategy's ranks: experts held by each rank and the bytes of rank 0 (which
    holds the most: the remainder goes to the first ranks)."""
    if not shape.is_moe:
        return {}
    if spec.axis("ep") is None:
        options = {"without ep": spec, "with ep": StrategySpec.parse(f"{spec.canonical}xep")}
    else:
        options = {"without ep": StrategySpec(tuple(a for a in spec.axes if a.name != "ep")),
                   "with ep": spec}
    out = {}
    for name, option in options.items():
        sizes = option.sizes()
        ranks = sizes.get("dp", 1) * sizes.get("tp", 1)
        held = ([expert_range(shape.num_experts, ranks, r) for r in range(ranks)]
                if name == "with ep" else [(0, shape.num_experts)] * ranks)
        first = MeshPoint(dict.fromkeys(sizes, 0), sizes)  # rank 0: the most experts
        cost = option.cost(shape.whole_model_cost(), first, shape.as_hf_config())
        out[name] = {"strategy": str(option), "experts_per_rank": [e - f for f, e in held],
                     "expert_bytes_per_rank": cost.expert_weight_params() * dtype_bytes,
                     "weight_bytes_per_rank": cost.weight_bytes(dtype_bytes, quantization),
                     "errors": option.model_errors(shape.as_hf_config())}
    return out

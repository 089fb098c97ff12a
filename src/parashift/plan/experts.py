"""MoE in `plan`: the two ways to hold the experts over a strategy's ranks, replicated (no
ep) or sharded over the dp x tp ranks (ep), with what each costs a rank; and under ep over
several engines, which experts each node holds and what the expert dispatch moves across
nodes."""

from __future__ import annotations

from typing import Any

from parashift.plan.shape import ModelShape
from parashift.strategies.expert import expert_range
from parashift.strategies.layout import MeshPoint
from parashift.strategies.mesh import DeviceMesh
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


def expert_placement(shape: ModelShape, spec: StrategySpec, mesh: DeviceMesh) -> list[dict]:
    """Under ep, for each node: its ranks and the global ids of the experts they hold (the
    same ids in every MoE layer), from the strategy's shard plan of each rank."""
    hf_config = shape.as_hf_config()
    nodes: dict[int, dict] = {}
    for r in mesh.ranks:
        first, end = spec.shard(MeshPoint(r.coords, spec.sizes()), hf_config).experts
        node = nodes.setdefault(r.node, {"node": r.node, "ranks": [], "experts": set()})
        node["ranks"].append(r.rank)
        node["experts"].update(range(first, end))
    return [{**n, "experts": sorted(n["experts"])} for _, n in sorted(nodes.items())]


def dispatch_bytes(hidden_size: int, moe_layers: int, dtype_bytes: int,
                   group_nodes: list[list[int]]) -> dict[str, int]:
    """Bytes the expert dispatch moves per step, per token of each engine, in all and across
    nodes. `group_nodes`: for every ep group, the node of each of its ranks.

    distributed/expert_dispatch.py: an ep group is the engines' ranks of one tp coordinate
    (`GroupSpec("ep", ("dp",))`). In each MoE layer every rank gathers every peer's tokens'
    hidden states (all-to-all on gloo, all_gather on nccl), runs its experts on all of them
    and sends each peer the partial outputs for that peer's tokens (all-to-all, or
    reduce_scatter). A hidden state is whole: the MoE block's input is replicated over tp
    (the attention output is all-reduced), and each tp worker exchanges it in full with its
    own group, so tp multiplies the bytes by tp, one group per tp coordinate.

    So one rank, per token of its engine and MoE layer, sends one vector of hidden_size x
    dtype_bytes to each peer and, for a peer's token, one partial back: 2 vectors per peer
    per token (it receives as much). Off-node: the peers on other nodes. Per step, summed
    over the MoE layers:
      bytes_per_token             = 2 x (ep - 1) x hidden x dtype x moe_layers (one rank)
      cross_node_bytes_per_token  = 2 x off-node peers x hidden x dtype x moe_layers (the rank
                                    with the most off-node peers)
      group_cross_node_bytes_per_token, total_cross_node_bytes_per_token: summed over the
                                    ranks of one group (the busiest) / of all tp groups
    Times the tokens of an engine's step for the step's bytes. These are balanced figures:
    the gather pads every rank's block to the largest rank's token count, so with uneven
    engines multiply by the largest count, not the mean. They are the bytes a rank exchanges
    with each off-node peer, exactly what gloo's all-to-all sends; nccl's ring all_gather /
    reduce_scatter relay blocks through neighbours, so its wire bytes between nodes can be
    fewer. Not counted: the per-step exchange of token counts (2 int64 per rank)."""
    vector = hidden_size * dtype_bytes  # [hidden] one token's state in one MoE layer
    per_peer = 2 * vector * moe_layers  # its state out and a partial back, every MoE layer
    off_node = [[sum(n != mine for n in nodes) for mine in nodes] for nodes in group_nodes]
    return {"bytes_per_token_per_layer": vector, "moe_layers": moe_layers,
            "group_size": max(len(nodes) for nodes in group_nodes),
            "num_groups": len(group_nodes),
            "bytes_per_token": per_peer * max(len(nodes) - 1 for nodes in group_nodes),
            "cross_node_bytes_per_token": per_peer * max(max(g) for g in off_node),
            "group_cross_node_bytes_per_token": per_peer * max(sum(g) for g in off_node),
            "total_cross_node_bytes_per_token": per_peer * sum(map(sum, off_node))}


def expert_dispatch(shape: ModelShape, spec: StrategySpec, mesh: DeviceMesh | None,
                    dtype_bytes: int) -> tuple[list[dict], dict[str, int] | None]:
    """Placement per node and dispatch bytes, for ep over several engines (else empty)."""
    if mesh is None or not shape.is_moe or spec.axis("ep") is None:
        return [], None
    node_of = {r.rank: r.node for r in mesh.ranks}
    groups = [[node_of[rank] for rank in g] for g in mesh.group("ep")]
    if max(map(len, groups)) < 2:  # one engine: its experts are all local, nothing moves
        return [], None
    return (expert_placement(shape, spec, mesh),
            dispatch_bytes(shape.hidden_size, shape.moe_layers, dtype_bytes, groups))

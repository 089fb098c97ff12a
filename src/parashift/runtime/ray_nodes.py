"""Which node of a Ray cluster each data-parallel rank's placement group goes to: a rank's
bundles packed on one node, the ranks spread over the nodes (the least used node with room
first). `parashift run --backend ray` asks Ray for exactly this placement and `parashift
plan --backend ray` prints it from `ray.nodes()` without launching anything."""

from __future__ import annotations

import os
from dataclasses import dataclass

from parashift.runtime.ray_cluster import bundle_totals


@dataclass
class RankNode:
    rank: int
    node: str | None  # node address, None when no node has room
    node_id: str | None
    bundles: list[dict[str, float]]


def cluster_nodes(address: str | None) -> list[dict]:
    """Alive nodes with their total resources (connects, reads, disconnects)."""
    from parashift.runtime.ray_cluster import import_ray

    ray = import_ray()
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto",
             log_to_driver=False, logging_level="ERROR")
    try:
        return alive_nodes(ray)
    finally:
        ray.shutdown()


def alive_nodes(ray) -> list[dict]:
    return [{"address": n["NodeManagerAddress"], "node_id": n["NodeID"],
             "resources": dict(n["Resources"])} for n in ray.nodes() if n.get("Alive")]


def place(nodes: list[dict], bundles: list[dict[str, float]], num_ranks: int
          ) -> list[RankNode]:
    free = [dict(n["resources"]) for n in nodes]
    used = [0] * len(nodes)
    need = bundle_totals(bundles)
    out = []
    for rank in range(num_ranks):
        room = [i for i, f in enumerate(free)
                if all(f.get(k, 0.0) + 1e-9 >= v for k, v in need.items())]
        spot = min(room, key=lambda i: (used[i], i)) if room else None
        if spot is not None:
            used[spot] += 1
            for k, v in need.items():
                free[spot][k] = free[spot].get(k, 0.0) - v
        node = nodes[spot] if spot is not None else {}
        out.append(RankNode(rank, node.get("address"), node.get("node_id"), bundles))
    return out

"""`parashift plan --backend ray`: which node of the connected Ray cluster each rank's
placement group would land on (first fit, a rank's bundles packed on one node, as
`parashift run --backend ray` asks for them), read from `ray.nodes()`; nothing is launched."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class RankPlacement:
    rank: int
    node: str | None  # node address, None when no node has room
    bundles: list[dict[str, float]]


def cluster_nodes(address: str | None) -> list[dict]:
    """Alive nodes with their total resources (connects, reads, disconnects)."""
    from parashift.ray_cluster import import_ray

    ray = import_ray()
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto",
             log_to_driver=False, logging_level="ERROR")
    try:
        return [{"address": n["NodeManagerAddress"], "resources": dict(n["Resources"])}
                for n in ray.nodes() if n.get("Alive")]
    finally:
        ray.shutdown()


def place(nodes: list[dict], bundles: list[dict[str, float]], num_ranks: int
          ) -> list[RankPlacement]:
    free = [dict(n["resources"]) for n in nodes]
    need = {k: sum(b.get(k, 0.0) for b in bundles) for k in ("CPU", "GPU")}
    out = []
    for rank in range(num_ranks):
        spot = next((i for i, f in enumerate(free)
                     if all(f.get(k, 0.0) + 1e-9 >= v for k, v in need.items())), None)
        if spot is not None:
            for k, v in need.items():
                free[spot][k] = free[spot].get(k, 0.0) - v
        out.append(RankPlacement(rank, None if spot is None else nodes[spot]["address"],
                                 bundles))
    return out

"""The device mesh: where every worker rank of a strategy goes (node, device, its dp/pp/tp
coordinates, its process name) and which ranks form each axis's process group. `parashift run`
places ranks with it; `parashift plan` will print it."""

from __future__ import annotations

from dataclasses import dataclass

from parashift.strategies.spec import StrategySpec


@dataclass(frozen=True)
class RankPlacement:
    rank: int  # global worker rank: dp-major, then pp, then tp
    node: int
    device: str  # "cuda:3", or "cpu[0-3]" for the cores of a CPU rank
    dp: int
    pp: int
    tp: int
    process_name: str
    cpu_indices: tuple[int, ...] = ()  # CPU: which of the node's cores (indexes) it owns


class DeviceMesh:
    def __init__(self, spec: StrategySpec, num_nodes: int = 1, devices_per_node: int = 1,
                 device_type: str = "cpu", first_dp_rank: int = 0):
        """`first_dp_rank`: for one node's part of a multi-node deployment (its dp ranks)."""
        self.spec = spec
        self.device_type = device_type
        self.dp, self.pp, self.tp = spec.size("dp"), spec.size("pp"), spec.size("tp")
        self.world_size = self.dp * self.pp * self.tp
        if num_nodes < 1 or devices_per_node < 1:
            raise ValueError("--nodes and devices per node must be >= 1")
        capacity = num_nodes * devices_per_node
        if device_type != "cpu" and self.world_size > capacity:
            raise ValueError(f"{spec} needs {self.world_size} devices; {num_nodes} node(s) x "
                             f"{devices_per_node} devices give {capacity}")
        per_node = -(-self.world_size // num_nodes)
        if self.tp > 1 and per_node % self.tp:
            raise ValueError(f"{spec}: the tp{self.tp} group of a rank must fit on one node "
                             f"({per_node} ranks per node)")
        self.num_nodes = num_nodes
        self.ranks = []
        for rank in range(self.world_size):
            dp, rest = divmod(rank, self.pp * self.tp)
            dp += first_dp_rank
            pp, tp = divmod(rest, self.tp)
            node, local = divmod(rank, per_node)
            cpus = self._cpu_indices(local, devices_per_node, per_node)
            device = (f"{device_type}:{local}" if device_type != "cpu" else
                      f"cpu[{cpus[0]}]" if len(cpus) == 1 else f"cpu[{cpus[0]}-{cpus[-1]}]")
            self.ranks.append(RankPlacement(rank, node, device, dp, pp, tp,
                                            self._process_name(dp, pp, tp),
                                            cpus if device_type == "cpu" else ()))

    def _process_name(self, dp: int, pp: int, tp: int) -> str:
        """A rank that is a whole engine is named for the engine; otherwise it is a worker."""
        if self.pp * self.tp == 1:
            return f"parashift-engine-dp{dp}"
        return (f"parashift-worker-dp{dp}" + (f"-pp{pp}" if self.pp > 1 else "")
                + (f"-tp{tp}" if self.tp > 1 else ""))

    @staticmethod
    def _cpu_indices(local: int, cores_per_node: int, per_node: int) -> tuple[int, ...]:
        """An equal slice of the node's cores; with more ranks than cores, one core each,
        round-robin."""
        count = max(1, cores_per_node // per_node)
        first = (local * count) % cores_per_node
        return tuple(range(first, first + count))

    def group(self, axis: str) -> list[list[int]]:
        """The ranks of every process group of `axis` ("dp", "pp" or "tp")."""
        key = {"dp": lambda r: (r.pp, r.tp), "pp": lambda r: (r.dp, r.tp),
               "tp": lambda r: (r.dp, r.pp)}[axis]
        groups: dict[tuple, list[int]] = {}
        for r in self.ranks:
            groups.setdefault(key(r), []).append(r.rank)
        return list(groups.values())

    def table(self) -> str:
        rows = ["rank  node  device        dp  pp  tp  process"]
        for r in self.ranks:
            rows.append(f"{r.rank:>4}  {r.node:>4}  {r.device:<12}  {r.dp:>2}  {r.pp:>2}  "
                        f"{r.tp:>2}  {r.process_name}")
        return "\n".join(rows)

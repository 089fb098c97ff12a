"""The device mesh: the only placement rule. For every rank of a strategy it decides the node,
the device (cuda:i, or a set of CPU cores), the coordinates on every mesh axis, the engine it
belongs to and its process name, and which ranks form each named process group. Offline,
served, headless and `plan` all build this same object."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parashift.strategies.composition import unravel
from parashift.strategies.spec import StrategySpec


@dataclass(frozen=True)
class RankPlacement:
    rank: int  # global rank: row-major over the mesh axes (engine axes outermost)
    node: int
    device: str  # "cuda:3", or "cpu[0-3]" for the cores of a CPU rank
    coords: dict[str, int]
    engine: int  # the engine (dp rank) it belongs to
    local_rank: int  # its index among its engine's workers
    process_name: str
    cpu_ids: tuple[int, ...] = ()  # CPU: the cores it is pinned to
    cuda_index: int | None = None  # GPU: the device index on its node

    def coord(self, axis: str) -> int:
        return self.coords.get(axis, 0)


@dataclass(frozen=True)
class EnginePlacement:
    """One engine and its workers: what the engine process pins itself to and starts."""

    engine: int
    process_name: str
    cpu_ids: tuple[int, ...]  # its workers' cores together (empty on GPU: unpinned)
    workers: tuple[RankPlacement, ...]


def engine_process_name(engine: int) -> str:
    return f"parashift-engine-dp{engine}"


def _cpu_label(cpus: tuple[int, ...]) -> str:
    if len(cpus) > 1 and cpus == tuple(range(cpus[0], cpus[-1] + 1)):
        return f"cpu[{cpus[0]}-{cpus[-1]}]"
    return f"cpu[{','.join(map(str, cpus))}]"


@dataclass
class DeviceMesh:
    """`devices_per_node`: GPUs, or CPU cores, of each node. `engines`: the engines this node
    runs (a node's part of a multi-node deployment; default: all). `cpu_ids`: the node's cores
    (default 0..devices_per_node-1; a launcher passes its own affinity)."""

    spec: StrategySpec
    devices_per_node: int = 1
    device_type: str = "cpu"
    num_nodes: int = 1
    engines: list[int] | None = None
    cpu_ids: list[int] | None = None
    ranks: list[RankPlacement] = field(init=False)
    warnings: list[str] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.devices_per_node < 1:
            raise ValueError("--nodes and devices per node must be >= 1")
        self.axes = self.spec.mesh_axes()
        self.inner = [a for a in self.axes if not a.spans_engines]
        processes = self.spec.processes()
        self.num_engines = processes.num_engines
        self.workers_per_engine = processes.workers_per_engine
        self.world_size = self.num_engines * self.workers_per_engine
        if self.world_size != self.spec.world_size:  # a plugin whose hooks disagree
            raise ValueError(f"strategy {self.spec}: its mesh axes make {self.spec.world_size} "
                             f"ranks but its processes hooks launch {self.num_engines} "
                             f"engine(s) x {self.workers_per_engine} worker(s)")
        engines = self.engines if self.engines is not None else list(range(self.num_engines))
        placed = [e * self.workers_per_engine + w for e in engines
                  for w in range(self.workers_per_engine)]
        self.warnings = []
        per_node = math.ceil(len(placed) / self.num_nodes)
        gpu = self.device_type != "cpu"
        if gpu:
            capacity = self.num_nodes * self.devices_per_node
            if len(placed) > capacity:
                raise ValueError(f"{self.spec} needs {len(placed)} devices; {self.num_nodes} "
                                 f"node(s) x {self.devices_per_node} devices give {capacity}")
            per_node = self.devices_per_node
        cores = list(self.cpu_ids) if self.cpu_ids is not None else list(
            range(self.devices_per_node))
        reserved = processes.reserved_cpus if not gpu else 0
        if reserved >= len(cores) and reserved:
            raise ValueError(f"{self.spec} keeps {reserved} core(s) for the API servers; the "
                             f"node has {len(cores)}")
        self.api_server_cpus = tuple(cores[:reserved])
        usable = cores[reserved:]
        self.ranks = []
        for index, rank in enumerate(placed):
            node, local = divmod(index, per_node)
            engine, worker = divmod(rank, self.workers_per_engine)
            coords = unravel(rank, self.axes)
            if gpu:
                cuda = rank % self.devices_per_node  # a node's GPUs, in global rank order
                cpus, device = (), f"{self.device_type}:{cuda}"
            else:
                cuda = None
                cpus = self._cpus(usable, local, min(per_node, len(placed) - node * per_node))
                device = _cpu_label(cpus)
            self.ranks.append(RankPlacement(rank, node, device, coords, engine, worker,
                                            self._process_name(engine, coords), cpus, cuda))
        if any(len({r.node for r in self.engine_ranks(e)}) > 1 for e in engines):
            self.warnings.append(f"an engine's workers span nodes ({per_node} ranks per node): "
                                 "its in-engine collectives cross the network")
        if not gpu and len(placed) > len(usable) * self.num_nodes:
            self.warnings.append(
                f"oversubscribed: {per_node} ranks per node share {len(usable)} core(s), one "
                "core each, round-robin")

    def _cpus(self, usable: list[int], local: int, ranks_on_node: int) -> tuple[int, ...]:
        """An equal slice of the node's usable cores; with more ranks than cores, one core
        each, round-robin."""
        if ranks_on_node > len(usable):
            return (usable[local % len(usable)],)
        count = len(usable) // ranks_on_node
        return tuple(usable[local * count:(local + 1) * count])

    def _process_name(self, engine: int, coords: dict[str, int]) -> str:
        """A rank that is a whole engine is named for the engine; otherwise it is a worker."""
        if self.workers_per_engine == 1:
            return engine_process_name(engine)
        return f"parashift-worker-dp{engine}" + "".join(
            f"-{a.name}{coords[a.name]}" for a in self.inner if a.size > 1)

    def engine_ranks(self, engine: int) -> list[RankPlacement]:
        return [r for r in self.ranks if r.engine == engine]

    def engine_placement(self, engine: int) -> EnginePlacement:
        workers = tuple(self.engine_ranks(engine))
        cpus = tuple(sorted({c for w in workers for c in w.cpu_ids}))
        return EnginePlacement(engine, engine_process_name(engine), cpus, workers)

    def group(self, name: str) -> list[list[int]]:
        """The ranks of every process group called `name` (spec.groups()), over the ranks
        this mesh places."""
        spec = next((g for g in self.spec.groups() if g.name == name), None)
        if spec is None:
            raise KeyError(f"{self.spec} has no {name!r} group; it has "
                           f"{', '.join(g.name for g in self.spec.groups())}")
        groups: dict[tuple, list[int]] = {}
        for r in self.ranks:
            key = tuple(v for k, v in r.coords.items() if k not in spec.axes)
            groups.setdefault(key, []).append(r.rank)
        return list(groups.values())

    def group_spans_nodes(self, name: str) -> bool:
        node_of = {r.rank: r.node for r in self.ranks}
        return any(len({node_of[r] for r in g}) > 1 for g in self.group(name))

    def table(self) -> str:
        names = [a.name for a in self.axes]
        rows = ["rank  node  device        " + "  ".join(f"{n:>2}" for n in names)
                + "  process"]
        for r in self.ranks:
            rows.append(f"{r.rank:>4}  {r.node:>4}  {r.device:<12}  "
                        + "  ".join(f"{r.coords[n]:>2}" for n in names) + f"  {r.process_name}")
        if self.api_server_cpus:
            rows.append(f"API servers on {_cpu_label(self.api_server_cpus)}")
        return "\n".join(rows + [f"note: {w}" for w in self.warnings])

"""What one node of a deployment runs: the `parashift run` settings (ServeArgs, with the
multi-node flags and their checks), this node's part of the device mesh, and each local
rank's share of the cores."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from parashift.config import EngineConfig
from parashift.engine.args import EngineArgs
from parashift.engine.engine_process import CpuShare
from parashift.strategies.mesh import DeviceMesh
from parashift.strategies.spec import StrategySpec


@dataclass
class ServeArgs:
    engine: EngineArgs
    host: str = "127.0.0.1"
    port: int = 8000
    api_server_count: int = 1
    served_model_name: str | None = None
    api_key: str | None = None
    shutdown_timeout: float = 10.0
    startup_timeout: float = 600.0
    log_level: str = "INFO"
    # Multi-node data parallel (vLLM's flags) and failure handling.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = 29550
    headless: bool = False
    restart_dead_engines: bool = False
    heartbeat_timeout: float = 5.0
    backend: str = "mp"  # "ray": engines (and their workers) as actors on a Ray cluster
    ray_address: str | None = None
    ray_placement: str = "pack"

    def check_backend(self) -> None:
        if self.backend not in ("mp", "ray"):
            raise ValueError(f"--backend {self.backend!r}: use mp or ray")
        if self.ray_placement not in ("pack", "spread"):
            raise ValueError(f"--ray-placement {self.ray_placement!r}: use pack or spread")
        if self.backend == "ray" and (self.headless or self.data_parallel_size_local is not None
                                      or self.data_parallel_address is not None):
            raise ValueError("--backend ray places every rank itself: drop --headless and "
                             "--data-parallel-size-local/--data-parallel-address")

    def local_ranks(self, dp_size: int) -> list[int]:
        """The data-parallel ranks this node runs; checks the multi-node flags."""
        start = self.data_parallel_start_rank
        if self.headless and start < 1:
            raise ValueError("--headless needs --data-parallel-start-rank >= 1: the head node "
                             "runs the ranks from 0")
        if not self.headless and start != 0:
            raise ValueError(f"--data-parallel-start-rank {start} is for --headless nodes; "
                             "the head node runs the ranks from 0")
        local = dp_size - start if self.data_parallel_size_local is None else (
            self.data_parallel_size_local)
        if local < 1 or start + local > dp_size:
            raise ValueError(f"--data-parallel-start-rank {start} and --data-parallel-size-local "
                             f"{local} do not fit in --data-parallel-size {dp_size}")
        if self.heartbeat_timeout <= 1.0:
            raise ValueError("--heartbeat-timeout must be above 1 second (the heartbeat period)")
        return list(range(start, start + local))

    def multi_node(self, dp_size: int) -> bool:
        return (self.headless or self.data_parallel_address is not None
                or len(self.local_ranks(dp_size)) < dp_size)


def node_mesh(config: EngineConfig, ranks: list[int]) -> DeviceMesh:
    """This node's part of the strategy: its dp ranks, each with its tp x pp workers, on its
    devices. Too few GPUs is an error here, before anything starts."""
    device = config.device.device
    units = len(os.sched_getaffinity(0)) if device == "cpu" else torch.cuda.device_count()
    par = config.parallel
    spec = StrategySpec.from_sizes(dp=len(ranks), tp=par.tensor_parallel_size,
                                   pp=par.pipeline_parallel_size)
    return DeviceMesh(spec, devices_per_node=max(1, units), device_type=device,
                      first_dp_rank=ranks[0])


def local_cpu_shares(mesh: DeviceMesh, num_threads: int | None) -> dict[int, CpuShare]:
    """On CPU every worker of this node's ranks gets its own slice of this process's cores
    (the mesh's rule; round-robin when there are more workers than cores). A lone rank
    without tensor parallel keeps them all, unpinned."""
    ranks = sorted({w.dp for w in mesh.ranks})
    if mesh.device_type != "cpu" or mesh.world_size == 1:
        return {rank: CpuShare([], num_threads) for rank in ranks}
    cores = sorted(os.sched_getaffinity(0))
    shares = {}
    for rank in ranks:
        workers = [[cores[c] for c in w.cpu_indices] for w in mesh.ranks if w.dp == rank]
        ids = sorted({c for w in workers for c in w})
        shares[rank] = (CpuShare(ids, num_threads or len(ids)) if mesh.tp == 1 else
                        CpuShare(ids, num_threads, workers))
    return shares

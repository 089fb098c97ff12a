"""The `parashift run` settings (ServeArgs), with the multi-node flags and their checks, and
the error that ends a launch before it serves (StartupError). Where this node's ranks go is
the device mesh's to say (engine/placement.py)."""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from parashift import env
from parashift.engine.args import EngineArgs
from parashift.runtime.autoscaler import AutoscaleConfig
from parashift.serve.limits import ServeLimits
from parashift.serve.prefix_router import RoutingConfig
from parashift.wire.cluster_auth import MIN_SECRET_CHARS


class StartupError(RuntimeError):
    """What ends a launch before it serves: one error naming the cause and the flag."""


@dataclass
class ServeArgs:
    engine: EngineArgs
    host: str = "127.0.0.1"
    port: int = 8000
    api_server_count: int = 1
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)
    shutdown_timeout: float = 10.0
    startup_timeout: float = 600.0
    request_timeout: float | None = None  # seconds one HTTP generation may take
    max_body_bytes: int = 8 << 20  # an HTTP request body past this is a 413
    log_level: str = "INFO"
    # Multi-node data parallel (vLLM's flags) and failure handling.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = 29550
    headless: bool = False
    restart_dead_engines: bool = False
    heartbeat_timeout: float = 5.0
    data_parallel_size_max: int | None = None  # elastic: POST /scale up to this many ranks
    drain_timeout: float = 60.0  # a scale-down waits this long for its ranks' requests
    autoscale: AutoscaleConfig | None = None  # with --data-parallel-size-min
    backend: str = "mp"  # "ray": engines (and their workers) as actors on a Ray cluster
    ray_address: str | None = None
    ray_placement: str = "pack"
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # which rank a request gets
    insecure_cluster: bool = False  # tcp links without the cluster secret: an explicit opt-out
    tool_call_parser: str | None = None  # set with --enable-auto-tool-choice
    limits: ServeLimits = field(default_factory=ServeLimits)  # what one API server admits

    def check_cluster_secret(self, tcp: bool) -> None:
        """Links over tcp (several nodes, Ray) admit only peers holding the cluster secret
        (wire/cluster_auth.py). Ray: a fresh one per launch, unless one is given. Several mp
        nodes: the user's (the same on every node), or a refusal that says how to make one."""
        secret = env.cluster_secret()
        if secret is not None and len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"PARASHIFT_CLUSTER_SECRET has {len(secret)} characters; a cluster "
                             f"secret needs at least {MIN_SECRET_CHARS}: python -c 'import "
                             "secrets; print(secrets.token_hex(32))' makes one")
        if not tcp or secret is not None:
            return
        if self.backend == "ray":
            env.set_cluster_secret(secrets.token_hex(32))
        elif self.insecure_cluster:
            logging.getLogger(__name__).warning(
                "--insecure-cluster: the links between nodes accept anyone who reaches their "
                "ports (prompts, outputs, shutdown); keep them on a private network")
        else:
            raise ValueError(
                "a multi-node deployment needs a cluster secret, the same on every node: "
                "export PARASHIFT_CLUSTER_SECRET=$(python -c 'import secrets; "
                "print(secrets.token_hex(32))') or give --cluster-secret-file PATH (a file of "
                "mode 0600); --insecure-cluster runs without one, on a private network only")

    def check_backend(self) -> None:
        if self.backend not in ("mp", "ray"):
            raise ValueError(f"--backend {self.backend!r}: use mp or ray")
        if self.ray_placement not in ("pack", "spread"):
            raise ValueError(f"--ray-placement {self.ray_placement!r}: use pack or spread")
        if self.backend == "ray" and (self.headless or self.data_parallel_size_local is not None
                                      or self.data_parallel_address is not None):
            raise ValueError("--backend ray places every rank itself: drop --headless and "
                             "--data-parallel-size-local/--data-parallel-address")

    def local_ranks(self, dp_size: int | None) -> list[int]:
        """The data-parallel ranks this node runs; checks the multi-node flags. `dp_size`
        None: a headless node before the head has said (its own flags name no size), which
        then needs --data-parallel-size-local."""
        start = self.data_parallel_start_rank
        if self.headless and start < 1:
            raise ValueError("--headless needs --data-parallel-start-rank >= 1: the head node "
                             "runs the ranks from 0")
        if not self.headless and start != 0:
            raise ValueError(f"--data-parallel-start-rank {start} is for --headless nodes; "
                             "the head node runs the ranks from 0")
        if dp_size is None and self.data_parallel_size_local is None:
            raise ValueError("a --headless node needs --data-parallel-size-local (or the "
                             "head's --data-parallel-size/--strategy) to know its ranks")
        local = dp_size - start if self.data_parallel_size_local is None else (
            self.data_parallel_size_local)
        if dp_size is None and local < 1:
            raise ValueError(f"--data-parallel-size-local {local}: a node runs at least 1 rank")
        if dp_size is not None and (local < 1 or start + local > dp_size):
            raise ValueError(f"--data-parallel-start-rank {start} and --data-parallel-size-local "
                             f"{local} do not fit in --data-parallel-size {dp_size}")
        if self.heartbeat_timeout <= 1.0:
            raise ValueError("--heartbeat-timeout must be above 1 second (the heartbeat period)")
        return list(range(start, start + local))

    def multi_node(self, dp_size: int) -> bool:
        return (self.headless or self.data_parallel_address is not None
                or len(self.local_ranks(dp_size)) < dp_size)

"""The strategy plugin interface: one class per parallel axis. The layout is decided by these
objects and nowhere else: every consumer (mesh, launcher, executors, model loading, Ray, plan)
calls the hooks below, composed over the axes of a spec by `AxesComposition`."""

from __future__ import annotations

from typing import Any

from parashift.strategies.layout import (
    DeviceCost,
    GroupSpec,
    MeshAxis,
    MeshPoint,
    ProcessPlan,
    ShardPlan,
)

# The hooks every axis must answer; `validate` has a default (nothing to check).
REQUIRED_HOOKS = ("mesh", "groups", "shard", "cost", "processes")


class Strategy:
    """One parallel axis. `name` is its token in a spec (`dp` in `dp4xtp2`); `is_flag` axes
    (like `ep`) take no size. Subclass a built-in axis to change one hook, or `Strategy` to add
    an axis (then every hook in REQUIRED_HOOKS is yours to write)."""

    name: str = ""
    axis: str = ""
    is_flag: bool = False
    available: bool = True

    def __init__(self, size: int = 1):
        self.size = size

    def options(self) -> dict[str, Any]:
        """What this axis is built with besides its size (keyword arguments of its class,
        plain data): travels with the spec, so every process builds the same axis."""
        return {}

    # --- validate ------------------------------------------------------------------------------
    def check_model(self, hf_config: Any) -> list[str]:
        """Errors a user can act on, for this axis against the model ([] when it fits)."""
        return []

    def check_layout(self, sizes: dict[str, int], hf_config: Any) -> list[str]:
        """Errors of this axis against the whole layout (`sizes`: every mesh axis's size),
        for what depends on the other axes too (ep: experts per dp x tp rank)."""
        return []

    def unavailable(self) -> str | None:
        """Why this axis cannot run yet (None when it can)."""
        if not self.available and (self.is_flag or self.size > 1):
            return f"{self.token}: {self.axis} parallel is not available yet"
        return None

    def validate(self, hf_config: Any) -> list[str]:
        """Everything that stops this axis from running this model."""
        return self.check_model(hf_config) + [e for e in [self.unavailable()] if e]

    # --- the layout hooks ----------------------------------------------------------------------
    def mesh(self) -> MeshAxis | None:
        """This axis's dimension of the device mesh; None for a flag that adds none (ep spans
        the dp x tp ranks that exist already)."""
        raise NotImplementedError

    def groups(self) -> list[GroupSpec]:
        """The process groups this axis needs, over mesh coordinates: only those a collective
        runs on (dp's replicas share no tensors and declare none)."""
        raise NotImplementedError

    def shard(self, plan: ShardPlan, at: MeshPoint, hf_config: Any) -> ShardPlan:
        """The rank at `at` narrowed by this axis (tp: its column/row slice; pp: its layers;
        ep: its experts)."""
        raise NotImplementedError

    def cost(self, cost: DeviceCost, plan: ShardPlan) -> DeviceCost:
        """`cost` of one device with this axis's share applied (per `plan`, the rank's shard
        plan) and the traffic on this axis's groups added."""
        raise NotImplementedError

    def processes(self, plan: ProcessPlan) -> ProcessPlan:
        """`plan` with what this axis needs launched (engines, workers, a coordinator)."""
        raise NotImplementedError

    @property
    def token(self) -> str:
        return self.name if self.is_flag else f"{self.name}{self.size}"

    @property
    def class_path(self) -> str:
        cls = type(self)
        return f"{cls.__module__}:{cls.__qualname__}"


def missing_hooks(cls: type[Strategy]) -> list[str]:
    """The required hooks `cls` leaves to the base class (which cannot answer them)."""
    return [hook for hook in REQUIRED_HOOKS if getattr(cls, hook) is getattr(Strategy, hook)]

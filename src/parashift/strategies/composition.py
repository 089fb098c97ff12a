"""The axes of a spec composed: every hook of the interface, answered for the whole layout by
asking each axis in canonical order (dp, pp, tp, ep, then third-party axes)."""

from __future__ import annotations

from typing import Any

from parashift.strategies.base import Strategy
from parashift.strategies.layout import (
    DeviceCost,
    GroupSpec,
    MeshAxis,
    MeshPoint,
    ProcessPlan,
    ShardPlan,
)


def unravel(index: int, axes: list[MeshAxis]) -> dict[str, int]:
    """The coordinates of rank `index`, row-major over `axes`."""
    coords, rest = {}, index
    for axis in reversed(axes):
        rest, coords[axis.name] = divmod(rest, axis.size)
    return {axis.name: coords[axis.name] for axis in axes}


class AxesComposition:
    axes: tuple[Strategy, ...]

    def validate_errors(self, hf_config: Any) -> list[str]:
        errors = [e for axis in self.axes for e in axis.validate(hf_config)]
        return errors or self.layout_errors(hf_config)

    def model_errors(self, hf_config: Any) -> list[str]:
        """What stops the layout on this model (what `plan` reports), availability aside."""
        errors = [e for axis in self.axes for e in axis.check_model(hf_config)]
        return errors or self.layout_errors(hf_config)

    def layout_errors(self, hf_config: Any) -> list[str]:
        sizes = self.sizes()
        return [e for axis in self.axes for e in axis.check_layout(sizes, hf_config)]

    def unavailable(self) -> list[str]:
        return [e for axis in self.axes if (e := axis.unavailable())]

    def mesh_axes(self) -> list[MeshAxis]:
        """Engine-spanning axes outermost, then those inside an engine: a rank's index is
        row-major over this list."""
        dims = [d for axis in self.axes if (d := axis.mesh()) is not None]
        return [d for d in dims if d.spans_engines] + [d for d in dims if not d.spans_engines]

    def sizes(self) -> dict[str, int]:
        return {d.name: d.size for d in self.mesh_axes()}

    def groups(self) -> list[GroupSpec]:
        return [g for axis in self.axes for g in axis.groups()]

    def shard(self, at: MeshPoint, hf_config: Any) -> ShardPlan:
        plan = ShardPlan()
        for axis in self.axes:
            plan = axis.shard(plan, at, hf_config)
        return plan

    def cost(self, whole_model: DeviceCost, at: MeshPoint, hf_config: Any) -> DeviceCost:
        """What the device at `at` holds and moves, from the whole model on one device."""
        plan = self.shard(at, hf_config)
        cost = whole_model
        for axis in self.axes:
            cost = axis.cost(cost, plan)
        return cost

    def local_groups(self) -> dict[str, list[list[int]]]:
        """The groups that live inside one engine, over its worker indices (the axes that span
        engines, like dp and ep, join groups across engines instead)."""
        inner = [d for d in self.mesh_axes() if not d.spans_engines]
        names = {d.name for d in inner}
        count = 1
        for d in inner:
            count *= d.size
        coords = [unravel(worker, inner) for worker in range(count)]
        out: dict[str, list[list[int]]] = {}
        for group in self.groups():
            if not set(group.axes) <= names:
                continue
            members: dict[tuple, list[int]] = {}
            for worker, point in enumerate(coords):
                key = tuple(v for k, v in sorted(point.items()) if k not in group.axes)
                members.setdefault(key, []).append(worker)
            out[group.name] = list(members.values())
        return out

    def processes(self) -> ProcessPlan:
        plan = ProcessPlan()
        for axis in self.axes:
            plan = axis.processes(plan)
        return plan

"""The strategy grammar: axes joined by `x`, in any order (`dp4xtp2`, `tp8`, `dp8xep`).
A sized axis is its name and a size >= 1; a flag axis (ep) is its bare name. The canonical
form lists dp, pp, tp, then the flags, then third-party axes; size-1 axes are dropped.

A parsed spec keeps its axis objects (plugins included) and travels to engines and workers as
such, or on a socket as its axes' class paths, sizes and options (`to_wire` / `from_wire`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from parashift.strategies.base import Strategy
from parashift.strategies.composition import AxesComposition
from parashift.strategies.disaggregated import pools_from_sizes
from parashift.strategies.registry import check_hooks, known_strategies, load_class

_ORDER = ("dp", "pp", "tp", "ep")
_POOLS = ("p", "d")
_TOKEN = re.compile(r"([a-z]+)(\d*)")


class StrategyAxis(msgspec.Struct, array_like=True, gc=False):
    """One axis of a parsed strategy as it crosses the wire: its class (`module:Class`), size
    and options (keyword arguments of the class, e.g. a pipeline's layer partition)."""

    class_path: str
    size: int
    options: dict[str, Any] = {}


def _pools_axis(text: str, pools: dict[str, int], axes: dict[str, Strategy]) -> Strategy:
    """`pPxdD`: the dp axis split into a prefill and a decode pool."""
    if set(pools) != set(_POOLS):
        raise ValueError(f"--strategy {text!r}: prefill/decode pools need both p and d "
                         "(like p1xd1)")
    if "dp" in axes:
        raise ValueError(f"--strategy {text!r}: p and d split the dp ranks; give pPxdD "
                         "without dp")
    if "ep" in axes:
        raise ValueError(f"--strategy {text!r}: prefill/decode pools with expert parallel "
                         "are not supported yet")
    return pools_from_sizes(pools["p"], pools["d"])


def _ordered(axes: list[Strategy]) -> tuple[Strategy, ...]:
    order = {n: i for i, n in enumerate(_ORDER)}
    return tuple(sorted(axes, key=lambda s: (order.get(s.name, len(order)), s.name)))


@dataclass(frozen=True)
class StrategySpec(AxesComposition):
    axes: tuple[Strategy, ...]

    @classmethod
    def parse(cls, text: str, extra: list[str] | None = None) -> StrategySpec:
        """`extra`: `module:Class` strategies to accept besides the registered ones."""
        known = known_strategies()
        for path in extra or []:
            plugin = load_class(path)
            known[plugin.name] = plugin
        grammar = ", ".join(f"{n}" if c.is_flag else f"{n}N" for n, c in known.items())
        grammar += ", pNxdN (prefill/decode pools)"
        if not text or not text.strip():
            raise ValueError(f"--strategy is empty; use axes joined by 'x' ({grammar})")
        axes: dict[str, Strategy] = {}
        pools: dict[str, int] = {}  # p and d: the prefill/decode split of the dp axis
        for token in text.strip().lower().split("x"):
            m = _TOKEN.fullmatch(token)
            if m and m.group(1) in _POOLS:
                name, digits = m.groups()
                if name in pools:
                    raise ValueError(f"--strategy {text!r}: axis {name!r} is given twice")
                if not digits or int(digits) < 1:
                    raise ValueError(f"--strategy {text!r}: {name} needs a size >= 1, "
                                     f"like {name}1")
                pools[name] = int(digits)
                continue
            if not m or m.group(1) not in known:
                raise ValueError(f"--strategy {text!r}: unknown axis {token!r}; known: {grammar}")
            name, digits = m.groups()
            strategy_cls = known[name]
            if name in axes:
                raise ValueError(f"--strategy {text!r}: axis {name!r} is given twice")
            if strategy_cls.is_flag:
                if digits:
                    raise ValueError(f"--strategy {text!r}: {name} is a flag and takes no size")
                axes[name] = strategy_cls(1)
                continue
            if not digits or int(digits) < 1:
                raise ValueError(f"--strategy {text!r}: {name} needs a size >= 1, like {name}2")
            axes[name] = strategy_cls(int(digits))
        if pools:
            axes["dp"] = _pools_axis(text, pools, axes)
        # The built-in axes are always present (at size 1), so that every layout has them.
        for name in ("dp", "pp", "tp"):
            axes.setdefault(name, known[name](1))
        for axis in axes.values():
            check_hooks(type(axis))
        return cls(_ordered(list(axes.values())))

    @classmethod
    def from_sizes(cls, dp: int = 1, tp: int = 1, pp: int = 1, ep: bool = False
                   ) -> StrategySpec:
        parts = [f"dp{dp}", f"pp{pp}", f"tp{tp}"] + (["ep"] if ep else [])
        return cls.parse("x".join(parts))

    def to_wire(self) -> list[StrategyAxis]:
        return [StrategyAxis(a.class_path, a.size, a.options()) for a in self.axes]

    @classmethod
    def from_wire(cls, axes: list[StrategyAxis]) -> StrategySpec:
        """The same axis classes (loaded by path, so a plugin given as `module:Class` needs no
        entry point where the spec arrives) at the same sizes."""
        loaded = []
        for axis in axes:
            strategy_cls = load_class(axis.class_path)
            check_hooks(strategy_cls)
            loaded.append(strategy_cls(axis.size, **axis.options))
        return cls(_ordered(loaded))

    def with_options(self, name: str, **options: Any) -> StrategySpec:
        """This spec with axis `name` rebuilt with `options` added (e.g. pp's partition)."""
        axes = [type(a)(a.size, **{**a.options(), **options}) if a.name == name else a
                for a in self.axes]
        return type(self)(tuple(axes))

    def with_size(self, name: str, size: int) -> StrategySpec:
        """This spec with axis `name` at `size` (elastic dp: the layout at another size)."""
        return type(self)(tuple(type(a)(size, **a.options()) if a.name == name else a
                                for a in self.axes))

    def axis(self, name: str) -> Strategy | None:
        return next((a for a in self.axes if a.name == name), None)

    def size(self, name: str) -> int:
        """An axis's size (a flag: 1 when given, 0 when not). For the grammar, validation and
        display; layout decisions go through the hooks."""
        axis = self.axis(name)
        if axis is None:
            return 0 if name == "ep" else 1
        return axis.size

    @property
    def canonical(self) -> str:
        tokens = [a.token for a in self.axes if a.is_flag or a.size > 1]
        return "x".join(tokens) or "dp1"

    @property
    def world_size(self) -> int:
        """Devices in all: the product of the mesh axes."""
        size = 1
        for d in self.mesh_axes():
            size *= d.size
        return size

    def validate(self, hf_config: Any) -> None:
        errors = self.validate_errors(hf_config)
        if errors:
            raise ValueError(f"strategy {self.canonical}: " + "; ".join(errors))

    def __str__(self) -> str:
        return self.canonical

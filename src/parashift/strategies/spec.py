"""The strategy grammar: axes joined by `x`, in any order (`dp4xtp2`, `tp8`, `dp8xep`).
A sized axis is its name and a size >= 1; a flag axis (ep) is its bare name. The canonical
form lists dp, pp, tp, then the flags, then third-party axes; size-1 axes are dropped."""

from __future__ import annotations

import re
from dataclasses import dataclass

from parashift.strategies.base import Strategy
from parashift.strategies.registry import known_strategies, load_class

_ORDER = ("dp", "pp", "tp", "ep")
_TOKEN = re.compile(r"([a-z]+)(\d*)")


@dataclass(frozen=True)
class StrategySpec:
    axes: tuple[Strategy, ...]

    @classmethod
    def parse(cls, text: str, extra: list[str] | None = None) -> StrategySpec:
        """`extra`: `module:Class` strategies to accept besides the registered ones."""
        known = known_strategies()
        for path in extra or []:
            plugin = load_class(path)
            known[plugin.name] = plugin
        grammar = ", ".join(f"{n}" if c.is_flag else f"{n}N" for n, c in known.items())
        if not text or not text.strip():
            raise ValueError(f"--strategy is empty; use axes joined by 'x' ({grammar})")
        axes: dict[str, Strategy] = {}
        for token in text.strip().lower().split("x"):
            m = _TOKEN.fullmatch(token)
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
        order = {n: i for i, n in enumerate(_ORDER)}
        ordered = sorted(axes.values(), key=lambda s: (order.get(s.name, len(order)), s.name))
        return cls(tuple(ordered))

    @classmethod
    def from_sizes(cls, dp: int = 1, tp: int = 1, pp: int = 1, ep: bool = False
                   ) -> StrategySpec:
        parts = [f"dp{dp}", f"pp{pp}", f"tp{tp}"] + (["ep"] if ep else [])
        return cls.parse("x".join(parts))

    def size(self, name: str) -> int:
        for axis in self.axes:
            if axis.name == name:
                return axis.size
        return 0 if name == "ep" else 1

    @property
    def canonical(self) -> str:
        tokens = [a.token for a in self.axes if a.is_flag or a.size > 1]
        return "x".join(tokens) or "dp1"

    @property
    def world_size(self) -> int:
        return self.size("dp") * self.size("pp") * self.size("tp")

    def model_errors(self, hf_config) -> list[str]:
        return [e for axis in self.axes for e in axis.check_model(hf_config)]

    def unavailable(self) -> list[str]:
        return [e for axis in self.axes if (e := axis.unavailable())]

    def validate(self, hf_config) -> None:
        errors = [e for axis in self.axes for e in axis.validate(hf_config)]
        if errors:
            raise ValueError(f"strategy {self.canonical}: " + "; ".join(errors))

    def __str__(self) -> str:
        return self.canonical

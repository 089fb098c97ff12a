"""Strategy classes by spec token: the built-ins, third-party classes registered under the
entry-point group `parashift.strategies`, or a `module:Class` given directly."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from parashift.strategies.base import Strategy
from parashift.strategies.builtin import (
    DataParallel,
    ExpertParallel,
    PipelineParallel,
    TensorParallel,
)

ENTRY_POINT_GROUP = "parashift.strategies"
_BUILTINS: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (DataParallel, PipelineParallel, TensorParallel, ExpertParallel)
}


def load_class(path: str) -> type[Strategy]:
    """`package.module:ClassName` -> the class (must subclass Strategy)."""
    module, _, name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load strategy {path!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(f"{path!r} is not a parashift Strategy subclass")
    return cls


def known_strategies() -> dict[str, type[Strategy]]:
    found = dict(_BUILTINS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise ValueError(f"entry point {ep.name!r} of {ENTRY_POINT_GROUP} is not a Strategy")
        found.setdefault(cls.name, cls)
    return found

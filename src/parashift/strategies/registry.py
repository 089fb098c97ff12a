"""Strategy classes by spec token: the built-ins, third-party classes registered under the
entry-point group `parashift.strategies`, or a `module:Class` given directly. A class that
leaves a required hook unanswered is refused here, before anything is launched."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from parashift.strategies.base import REQUIRED_HOOKS, Strategy, missing_hooks
from parashift.strategies.data import DataParallel
from parashift.strategies.expert import ExpertParallel
from parashift.strategies.pipeline import PipelineParallel
from parashift.strategies.tensor import TensorParallel

ENTRY_POINT_GROUP = "parashift.strategies"
_BUILTINS: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (DataParallel, PipelineParallel, TensorParallel, ExpertParallel)
}


def load_class(path: str) -> type[Strategy]:
    """`package.module:ClassName` -> the class (must subclass Strategy)."""
    module, _, name = path.partition(":")
    try:
        cls = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot load strategy {path!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ValueError(f"{path!r} is not a parashift Strategy subclass")
    return cls


def check_hooks(cls: type[Strategy]) -> None:
    """Refuse an axis that cannot say where its ranks go, what they load or what they cost:
    launching it would silently drop it."""
    missing = missing_hooks(cls)
    if missing:
        raise ValueError(
            f"strategy axis {cls.name!r} ({cls.__module__}:{cls.__qualname__}) does not "
            f"implement the hook(s) {', '.join(missing)}; every axis answers "
            f"{', '.join(REQUIRED_HOOKS)} (subclass a built-in axis to inherit them)")


def known_strategies() -> dict[str, type[Strategy]]:
    found = dict(_BUILTINS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise ValueError(f"entry point {ep.name!r} of {ENTRY_POINT_GROUP} is not a Strategy")
        # A plugin may replace a built-in axis of the same name (a placement of its own).
        found[cls.name] = cls
    return found

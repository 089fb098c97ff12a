"""The strategy plugin interface: one class per parallel axis."""

from __future__ import annotations

from typing import Any


class Strategy:
    """One parallel axis (data, tensor, pipeline, expert). `name` is its token in a strategy
    spec (`dp` in `dp4xtp2`); `is_flag` axes (like `ep`) take no size."""

    name: str = ""
    axis: str = ""
    is_flag: bool = False
    available: bool = True

    def __init__(self, size: int = 1):
        self.size = size

    def check_model(self, hf_config: Any) -> list[str]:
        """Errors a user can act on, for this axis against the model ([] when it fits)."""
        return []

    def unavailable(self) -> str | None:
        """Why this axis cannot run yet (None when it can)."""
        if not self.available and (self.is_flag or self.size > 1):
            return f"{self.token}: {self.axis} parallel is not available yet"
        return None

    def validate(self, hf_config: Any) -> list[str]:
        """Everything that stops this axis from running this model."""
        return self.check_model(hf_config) + [e for e in [self.unavailable()] if e]

    @property
    def token(self) -> str:
        return self.name if self.is_flag else f"{self.name}{self.size}"

"""What ends a launch before it serves: one error naming the cause and the flag."""

from __future__ import annotations


class StartupError(RuntimeError):
    pass

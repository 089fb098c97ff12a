"""What can go wrong with a request on its way through the engines (the engine died, the
engine refused it alone, no engine can take it now); the HTTP side turns each into its
status."""

from __future__ import annotations

from collections.abc import Callable


class EngineDeadError(RuntimeError):
    """The engine serving a request died (`rank`, where one did); the request cannot finish
    there."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class RequestFailedError(ValueError):
    """The engine refused one request (400: bad; 429: its waiting queue is full), apart from
    any engine death."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
        self.type = {429: "rate_limit_error", 503: "service_unavailable_error"}.get(
            status, "invalid_request_error")


class DecodeRefusedError(RequestFailedError):
    """Every rank refused a sample's decode phase (429). Its prompt's KV waits in the node's
    tier, so only that phase goes again: `resume()` sends it to the least loaded rank, as if
    none had refused it yet (serve/handoff.py)."""

    def __init__(self, message: str, resume: Callable[[], None]):
        super().__init__(message, 429)
        self.resume = resume


class EngineUnavailableError(RuntimeError):
    """No engine can take a request right now (still starting, or all dead)."""


class RankDrainingError(RuntimeError):
    """The request's rank is leaving the deployment (a scale-down): a request that has not
    started moves to another rank; one that has keeps running there until the drain ends."""

"""What one API server admits and for how long: the per-request output budget, the stream and
connection limits, the Host allowlist and the admin key. Set by `parashift run`'s flags, read
by the API server; one frozen record so that every bound has one name and one default."""

from __future__ import annotations

from dataclasses import dataclass, field

from parashift.engine.structured_output import COMPILE_TIMEOUT_S

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")


@dataclass(frozen=True)
class ServeLimits:
    # n x (max_tokens + echoed prompt) x (1 + logprobs) of one request; None: a default that
    # fits the model's context (serve/output_budget.py)
    max_request_output_units: int | None = None
    stream_idle_timeout: float = 60.0  # seconds a client may read nothing before it is dropped
    max_connections: int = 1024  # open HTTP connections per API server
    non_stream_timeout: float = 600.0  # seconds a non-streamed request may take (504 beyond)
    max_tokenize_queue: int = 64  # requests waiting for the tokenizer thread (429 beyond)
    bind_host: str = "127.0.0.1"  # a loopback bind serves only LOOPBACK_HOSTS + allowed_hosts
    allowed_hosts: tuple[str, ...] = ()  # --allowed-hosts: more Host names served
    admin_api_key: str | None = field(default=None, repr=False)  # the admin routes' own key
    enable_admin_routes: bool = False  # admin routes without a key (a trusted network only)
    # seconds a constraint may compile here (killed, 400); the engines' own limit is the
    # ceiling, so that no constraint passes here and then fails in an engine
    grammar_compile_timeout: float = COMPILE_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("stream_idle_timeout", "non_stream_timeout", "grammar_compile_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        for name in ("max_connections", "max_tokenize_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.grammar_compile_timeout > COMPILE_TIMEOUT_S:
            raise ValueError(f"--grammar-compile-timeout must be at most {COMPILE_TIMEOUT_S:g} "
                             "(the engines' own compile limit)")
        if self.max_request_output_units is not None and self.max_request_output_units < 1:
            raise ValueError("--max-request-output-units must be >= 1")

    @property
    def admin_routes(self) -> bool:
        return self.admin_api_key is not None or self.enable_admin_routes

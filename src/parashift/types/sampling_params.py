"""Per-request sampling settings, validated with messages that name the bad field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from parashift.types.field_types import check_field_types
from parashift.types.structured_outputs import StructuredOutputsParams

# Stop strings are matched on every new token: their number and length bound that work.
MAX_STOPS = 64
MAX_STOP_CHARS = 1024


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives per token (0: only the chosen)
    prompt_logprobs: None = None
    skip_special_tokens: bool = True
    # the output's constraint: a JSON schema, regex, choice or grammar (xgrammar masks tokens)
    structured_outputs: StructuredOutputsParams | None = None
    # Prefix-cache blocks are shared only between requests with the same salt (vLLM's field).
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # what vLLM's users write
            self.structured_outputs = _constraint_from_dict(self.structured_outputs)
        check_field_types(self)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        check_field_types(self)  # (also after a change since construction)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable), 0 (disable) or at least 1, "
                             f"got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if len(self.stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")

    def for_sample(self, index: int) -> SamplingParams:
        """The params of the index-th of n independent samples (each its own seed)."""
        if self.n == 1:
            return self
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _constraint_from_dict(fields: dict) -> StructuredOutputsParams:
    """{"json": schema} and the like, as StructuredOutputsParams; TypeError for another key."""
    known = [f.name for f in dataclasses.fields(StructuredOutputsParams)]
    unknown = [k for k in fields if k not in known]
    if unknown:
        raise TypeError(f"SamplingParams.structured_outputs: unknown field {unknown[0]!r} "
                        f"(it takes {', '.join(known)})")
    return StructuredOutputsParams(**fields)

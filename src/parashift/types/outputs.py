"""Plain data passed between the scheduler, the model runner and the engine's clients."""

from __future__ import annotations

from dataclasses import dataclass, field

from parashift.types.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt and, after a preemption, the outputs so far
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """What changed for a request the runner already holds."""

    req_id: str
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int
    token_offset: int  # the position of new_token_ids[0]


@dataclass
class KVTransferJob:
    """Copies between the KV cache and the host tier (kv_tiers/): `load` fills `block_ids`
    from `slots`, a store reads them into the slots. Every worker of the engine copies its
    share and reports job `job` done on the engine's job board."""

    job: int
    load: bool
    block_ids: list[int]
    slots: list[int]
    # A store the worker copies before it returns the step's result (a hand-off's last
    # blocks: the decode rank takes them at once), not on its copy thread.
    urgent: bool = False


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute this step
    total_num_scheduled_tokens: int
    freed_req_ids: set[str]  # finished, aborted or preempted: drop their runner state
    grammar: GrammarBitmask | None = None  # the constrained rows that sample this step
    # Async scheduling: constrained rows whose mask depends on tokens still in flight. The
    # mask follows the batch (the runner runs the forward, then waits for it to sample).
    deferred_grammar_req_ids: list[str] | None = None
    kv_jobs: list[KVTransferJob] = field(default_factory=list)  # started with this step

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def grammar_deferred(self) -> bool:
        return self.deferred_grammar_req_ids is not None


@dataclass
class GrammarBitmask:
    """Structured outputs: for each request in `req_ids`, the tokens its grammar allows next,
    as int32 words (bit t of word t // 32), `words` a row, the rows' bytes in order."""

    req_ids: list[str]
    words: int
    bits: bytes


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the sampled token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int  # 1-based rank of the sampled token in the distribution


@dataclass
class ModelRunnerOutput:
    # Only requests whose prompt is complete sample; partial prefill chunks do not.
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class KVTierStats:
    """An engine's KV tier traffic since it started (engine/kv_tier_connector.py)."""

    host_hit_blocks: int = 0  # blocks loaded from the host tier
    disk_hit_blocks: int = 0  # blocks read from the disk tier (then loaded through the host)
    loaded_bytes: int = 0
    stored_bytes: int = 0
    host_loads: int = 0  # loads served from the host tier alone
    host_load_seconds: float = 0.0  # summed: from the lookup to the blocks in the pool
    disk_loads: int = 0  # loads that read from disk
    disk_load_seconds: float = 0.0
    failed_loads: int = 0  # recomputed instead (a corrupt or missing block, a failed copy)
    # prefill/decode pools over nodes: blocks fetched from the head node's tier
    remote_hit_blocks: int = 0
    remote_loads: int = 0
    remote_load_seconds: float = 0.0


@dataclass
class SchedulerStats:
    num_waiting: int
    num_running: int
    kv_cache_usage: float
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0  # since the engine started
    num_prefix_cache_resets: int = 0  # since the engine started: the cache emptied this often
    kv_tiers: KVTierStats | None = None  # with --kv-offloading-size
    # The work it holds, in tokens (the DP router's token load score): prompt tokens still to
    # compute (waiting requests' whole prompts, running ones' unprefilled rest) and output
    # tokens its requests may still make (max_tokens, within max_model_len).
    prefill_tokens_left: int = 0
    output_tokens_left: int = 0

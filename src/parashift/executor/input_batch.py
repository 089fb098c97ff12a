"""The model runner's persistent input batch: one row per request it holds, kept across steps.

A row holds the request's token ids, its counts, its block-table row and its sampling settings
as columns. Each step applies only what changed (requests added, freed or preempted; new
tokens; new blocks), and the step's inputs are gathered from the rows with array ops. A freed
row is filled by the last one, so the rows stay dense.

Token ids are written at their positions, so the runner's own copy of a token it sampled
(async scheduling: the next step runs before the scheduler has it) and the scheduler's later
copy land in one place, never appended twice. A token the runner sampled is `pending` until
its value is on the host: its row holds the token's index among the last step's sampled ids,
which the runner copies into the next step's inputs on the device; the value comes with
`resolve_pending` or the scheduler's copy. One step at a time the runner keeps no copy: the
scheduler sends every token. Torch-free: the scheduler tests drive it."""

from __future__ import annotations

import numpy as np

from parashift.types.outputs import NewRequestData, SchedulerOutput
from parashift.types.sampling_params import SamplingParams
from parashift.types.token_counts import TokenCounts

# One value per row: (name, dtype, the value of an empty row). Sampling columns: greedy rows
# have temperature 0 and neutral filters.
_COLUMNS = (
    ("num_tokens", np.int64, 0), ("num_prompt_tokens", np.int64, 0),
    ("num_computed_tokens", np.int64, 0), ("num_blocks", np.int64, 0),
    ("temperature", np.float32, 0.0), ("top_k", np.int64, 0), ("top_p", np.float32, 1.0),
    ("min_p", np.float32, 0.0), ("seeded", np.bool_, False), ("has_logprobs", np.bool_, False),
    ("penalized", np.bool_, False),
    # The newest token (at num_tokens - 1) as an index into the last sampled ids, not yet on
    # the host; -1 when its value is here.
    ("pending", np.int64, -1),
)
_UNKNOWN = -1  # a pending token's host value: an input built from it would fail, not mislead


class InputBatch:
    def __init__(self, max_model_len: int, block_size: int, max_num_reqs: int = 16):
        # A request that reached max_model_len tokens still samples one more.
        self.width = max_model_len + 1
        self.max_blocks = -(-self.width // block_size)
        self.req_ids: list[str] = []  # row -> request id
        self.rows: dict[str, int] = {}
        self.params: list[SamplingParams] = []
        self.counts: list[TokenCounts | None] = []  # for penalties, only where used
        self.version = 0  # bumped when rows come or go: what the sampling columns' cache keys
        self.num_penalized = 0  # rows whose request has penalties (their counts change)
        self._allocate(max_num_reqs)

    def _allocate(self, capacity: int) -> None:
        grown = self.__dict__.get("token_ids") is not None
        self.capacity = capacity
        arrays = [(name, (capacity,), dtype, fill) for name, dtype, fill in _COLUMNS]
        arrays += [("token_ids", (capacity, self.width), np.int64, 0),
                   ("block_table", (capacity, self.max_blocks), np.int64, 0)]
        for name, shape, dtype, fill in arrays:
            new = np.full(shape, fill, dtype=dtype)
            if grown:
                prev = getattr(self, name)
                new[: len(prev)] = prev
            setattr(self, name, new)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # --- a step's deltas ------------------------------------------------------------------------
    def apply(self, out: SchedulerOutput) -> None:
        """Requests freed, new ones (a preempted request comes back as new), and the running
        ones' new tokens and blocks."""
        for req_id in out.freed_req_ids:
            self.remove(req_id)
        for new in out.new_reqs:
            self.add(new)
        rows = self.rows
        for cached in out.cached_reqs:
            row = rows[cached.req_id]
            self.write_tokens(row, cached.token_offset, cached.new_token_ids)
            self.append_blocks(row, cached.new_block_ids)
            self.num_computed_tokens[row] = cached.num_computed_tokens

    def add(self, new: NewRequestData) -> None:
        if new.req_id in self.rows:  # preempted and readmitted before its freeing was applied
            self.remove(new.req_id)
        if self.num_reqs == self.capacity:
            self._allocate(2 * self.capacity)
        row = self.num_reqs
        self.req_ids.append(new.req_id)
        self.rows[new.req_id] = row
        tokens, prompt = new.token_ids, new.num_prompt_tokens
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = prompt
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.pending[row] = -1
        self.append_blocks(row, new.block_ids)
        params = new.params
        greedy = params.is_greedy
        self.temperature[row] = 0.0 if greedy else params.temperature
        self.top_k[row] = 0 if greedy else max(params.top_k, 0)
        self.top_p[row] = 1.0 if greedy else params.top_p
        self.min_p[row] = 0.0 if greedy else params.min_p
        self.seeded[row] = params.seed is not None and not greedy
        self.has_logprobs[row] = params.logprobs is not None
        self.penalized[row] = params.has_penalties
        self.num_penalized += params.has_penalties
        self.params.append(params)
        self.counts.append(TokenCounts(tokens[:prompt], tokens[prompt:])
                           if params.has_penalties else None)
        self.version += 1

    def remove(self, req_id: str) -> None:
        """Drop a request's row; the last row moves into its place."""
        row = self.rows.pop(req_id, None)
        if row is None:
            return
        self.version += 1
        self.num_penalized -= bool(self.penalized[row])
        last = self.num_reqs - 1
        # A gathered table is as wide as its widest row: the others read zeros past their end.
        self.block_table[row, : self.num_blocks[row]] = 0
        if row != last:
            moved = self.req_ids[last]
            self.rows[moved] = row
            self.req_ids[row] = moved
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            b = self.num_blocks[last]
            self.block_table[row, :b] = self.block_table[last, :b]
            for name, *_ in _COLUMNS:
                column = getattr(self, name)
                column[row] = column[last]
            self.params[row] = self.params[last]
            self.counts[row] = self.counts[last]
            self.block_table[last, :b] = 0
        self.req_ids.pop()
        self.params.pop()
        self.counts.pop()

    def write_tokens(self, row: int, offset: int, token_ids: list[int]) -> None:
        """Tokens at positions offset.. (those already there are the same tokens)."""
        if not token_ids:
            return
        end = offset + len(token_ids)
        known = first_new = int(self.num_tokens[row])
        if end == offset + 1:  # a decode step's one token: a scalar write is cheaper
            self.token_ids[row, offset] = token_ids[0]
        else:
            self.token_ids[row, offset:end] = token_ids
        if self.pending[row] >= 0 and offset < known <= end:  # the pending value came too
            self.pending[row] = -1
            first_new = known - 1
        if end > known:
            self.num_tokens[row] = end
        counts = self.counts[row]
        if counts is not None and end > first_new:
            counts.add(token_ids[first_new - offset:])

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks[row])
            self.block_table[row, start : start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    # --- a step's rows --------------------------------------------------------------------------
    def rows_of(self, req_ids: list[str]) -> np.ndarray:
        rows = self.rows
        return np.fromiter((rows[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

    def advance(self, rows: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """After a step computed `rows` up to `seq_lens` tokens: the indices (into `rows`) of
        those with all their known tokens computed now, which sample (a partial prefill chunk
        only fills the cache)."""
        self.num_computed_tokens[rows] = seq_lens
        return np.flatnonzero(seq_lens >= self.num_tokens[rows])

    def append_pending(self, rows: np.ndarray) -> None:
        """The runner's sampled tokens, still on the device (async scheduling): each row's
        next position holds the token at the same index among the sampled ids."""
        positions = self.num_tokens[rows]
        self.token_ids[rows, positions] = _UNKNOWN
        self.num_tokens[rows] = positions + 1
        self.pending[rows] = np.arange(len(rows))

    def pending_tokens(self, token_rows: np.ndarray, positions: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Of a step's input tokens (row, position), those still pending: their indices in the
        step's inputs, and their indices among the last sampled ids."""
        pending = self.pending[token_rows]
        at = np.flatnonzero((pending >= 0) & (positions == self.num_tokens[token_rows] - 1))
        return at, pending[at]

    def resolve_pending(self, token_ids: list[int]) -> None:
        """The last sampled ids, now on the host: the pending rows' values."""
        pending = self.pending[: self.num_reqs]
        rows = np.flatnonzero(pending >= 0)
        if not len(rows):
            return
        values = np.asarray(token_ids, dtype=np.int64)[pending[rows]]
        self.token_ids[rows, self.num_tokens[rows] - 1] = values
        self.pending[rows] = -1
        if self.num_penalized:
            for i in np.flatnonzero(self.penalized[rows]).tolist():
                self.counts[rows[i]].add([int(values[i])])

    def token_row(self, req_id: str) -> list[int]:
        row = self.rows[req_id]
        return self.token_ids[row, : self.num_tokens[row]].tolist()

    def block_row(self, req_id: str) -> list[int]:
        row = self.rows[req_id]
        return self.block_table[row, : self.num_blocks[row]].tolist()

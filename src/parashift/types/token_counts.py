"""The tokens one request has seen, for penalties: kept by the model runner's input batch
across steps (one dict lookup a token), read by layers/penalties.py. Numpy only."""

from __future__ import annotations

import numpy as np


class TokenCounts:
    """The tokens one request has seen: its prompt's (distinct, count 0) and its outputs' (with
    how often each came out), in the order first seen."""

    def __init__(self, prompt_ids: list[int], output_ids: list[int]):
        distinct = dict.fromkeys(prompt_ids)
        self._slots: dict[int, int] = {token: i for i, token in enumerate(distinct)}
        capacity = max(16, 2 * (len(self._slots) + len(output_ids)))
        self._ids = np.empty(capacity, dtype=np.int64)
        self._counts = np.zeros(capacity, dtype=np.float32)
        self._ids[: len(self._slots)] = list(self._slots)
        self._size = len(self._slots)
        self.add(output_ids)

    def add(self, output_ids: list[int]) -> None:
        for token in output_ids:
            slot = self._slots.get(token)
            if slot is None:
                slot = self._slots[token] = self._size
                if slot == len(self._ids):
                    self._ids = np.resize(self._ids, 2 * slot)
                    self._counts = np.concatenate([self._counts, np.zeros(slot, np.float32)])
                self._ids[slot] = token
                self._counts[slot] = 0.0
                self._size += 1
            self._counts[slot] += 1.0

    @property
    def token_ids(self) -> np.ndarray:  # [seen] int64
        return self._ids[: self._size]

    @property
    def output_counts(self) -> np.ndarray:  # [seen] float32, 0 for prompt-only tokens
        return self._counts[: self._size]

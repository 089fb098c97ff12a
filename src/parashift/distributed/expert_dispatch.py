"""Expert parallel's dispatch and combine: every rank's tokens go to every rank that holds some
of the experts, and each token's expert outputs come back summed.

Chosen: all-gather + reduce-scatter over the engines (the `ep` group: ranks with the same tp
coordinate, one per engine), padded to the largest rank's token count. Every collective has a
fixed shape known from one small exchange per step (the token counts, which also carry the
waves' "does any rank still have work"), so a rank with no tokens joins with zero rows and
nothing else is exchanged per layer. An all-to-all would move only the routed copies, but needs
per-layer split sizes first; docs/BENCHMARKS.md has the measured comparison."""

from __future__ import annotations

import torch

from parashift.distributed.communicator import GroupCommunicator


class ExpertDispatcher:
    """One per rank, shared by all its MoE layers. `begin_step` runs once per forward, before
    the layers, on every rank of the group (a rank without work included)."""

    def __init__(self, ep: GroupCommunicator):
        self.ep = ep
        self.counts: list[int] = []  # tokens of each rank this step

    @property
    def is_active(self) -> bool:
        return self.ep.world_size > 1

    def begin_step(self, num_tokens: int, has_work: bool) -> bool:
        """Exchange every rank's token count and work flag; True if any rank has work."""
        if not self.is_active:
            self.counts = [num_tokens]
            return has_work
        mine = torch.tensor([[num_tokens, int(has_work)]], dtype=torch.int64)
        every = self.ep.all_gather(mine, dim=0)  # [ranks, 2]
        self.counts = every[:, 0].tolist()
        return bool(every[:, 1].any())

    @property
    def max_tokens(self) -> int:
        return max(self.counts, default=0)

    def dispatch(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] -> [ranks * max_tokens, hidden]: every rank's tokens, each
        rank's block padded to the largest."""
        if not self.is_active:
            return hidden
        padded = hidden.new_zeros(self.max_tokens, hidden.shape[1])
        padded[: hidden.shape[0]] = hidden
        return self.ep.all_gather(padded, dim=0)

    def valid_rows(self, device: torch.device) -> torch.Tensor:
        """[ranks * max_tokens] bool: which dispatched rows are real tokens, not padding."""
        width = self.max_tokens
        index = torch.arange(width, device=device)
        counts = torch.tensor(self.counts, device=device)
        return (index[None, :] < counts[:, None]).reshape(-1)

    def combine(self, partial: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """[ranks * max_tokens, hidden] partial expert outputs -> [num_tokens, hidden]: this
        rank's rows summed over every rank's experts."""
        if not self.is_active:
            return partial
        return self.ep.reduce_scatter(partial)[:num_tokens]

"""Expert parallel's dispatch and combine: every rank's tokens go to every rank that holds some
of the experts, and each token's expert outputs come back summed.

The exchange is a gather and a scatter-sum of fixed shape: every engine's tokens, padded to the
largest engine's count, known from one small exchange per step (the token counts, which also
carry the waves' "does any engine still have work" and the prefill cadence's "is any engine
saturated"). A rank with no tokens joins with zero rows, and nothing else is exchanged per
layer.

How the bytes move depends on the backend (scripts/bench_moe.py; docs/BENCHMARKS.md): on gloo,
torch's all_gather and reduce_scatter take several times as long as an all-to-all of the same
blocks, so on CPU both directions are equal-block all-to-alls (the
gather sends this rank's block to every rank; the combine sends each rank the partial outputs
for its tokens and sums what comes back).
On nccl the native all_gather and reduce_scatter are used. A routed all-to-all, moving only
the copies a token's top-k experts need, saves little with 2 engines (with top-2 of 8 experts
79% of the tokens need the other engine) and needs per-layer split sizes: not chosen."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parashift.distributed.communicator import GroupCommunicator


class ExpertDispatcher:
    """One per rank, shared by all its MoE layers. `begin_step` runs once per forward, before
    the layers, on every rank of the group (a rank without work included)."""

    def __init__(self, ep: GroupCommunicator):
        self.ep = ep
        self.counts: list[int] = []  # tokens of each rank this step
        self.any_saturated = False  # whether any rank said it was saturated this step
        # This rank's own tokens routed to each expert, summed over the MoE layers, since the
        # last take_routed (the expert load: per rank, the basis for balancing)
        self.routed: torch.Tensor | None = None
        self.over_all_to_all = isinstance(ep.group, dist.ProcessGroupGloo)

    @property
    def is_active(self) -> bool:
        return self.ep.world_size > 1

    def begin_step(self, num_tokens: int, has_work: bool, saturated: bool = False) -> bool:
        """Exchange every rank's token count, work flag and saturation (engine/
        prefill_cadence.py); True if any rank has work."""
        if not self.is_active:
            self.counts, self.any_saturated = [num_tokens], saturated
            return has_work
        mine = torch.tensor([[num_tokens, int(has_work), int(saturated)]], dtype=torch.int64)
        every = self._gather(mine)  # [ranks, 3]
        self.counts = every[:, 0].tolist()
        self.any_saturated = bool(every[:, 2].any())
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
        return self._gather(padded)

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
        if not self.over_all_to_all:
            return self.ep.reduce_scatter(partial)[:num_tokens]
        received = self.ep.all_to_all(partial)  # block j: rank j's partials for our tokens
        return received.view(self.ep.world_size, -1, partial.shape[1]).sum(0)[:num_tokens]

    def count_routed(self, ids: torch.Tensor, num_experts: int) -> None:
        """`ids` [rows, top_k]: a layer's routing of the dispatched rows; this rank's own
        rows (its block, without padding) are counted in place on the device: no sync, and
        a CUDA graph's replay counts too."""
        if self.is_active:
            start = self.ep.rank * self.max_tokens
            ids = ids[start : start + self.counts[self.ep.rank]]
        if self.routed is None:
            self.routed = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
        flat = ids.flatten()
        self.routed.index_add_(0, flat, torch.ones_like(flat))

    def take_routed(self) -> list[int]:
        """The counts since the last call (none: no MoE layer ran yet)."""
        if self.routed is None:
            return []
        counts = self.routed.tolist()
        self.routed.zero_()
        return counts

    def _gather(self, block: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [ranks * n, ...], rank order."""
        if not self.over_all_to_all:
            return self.ep.all_gather(block, dim=0)
        return self.ep.all_to_all(block.repeat(self.ep.world_size, *[1] * (block.dim() - 1)))

"""Prefill/decode disaggregation (`p1xd1`, `p2xd2`, `p1xd1xtp2`): the data-parallel axis split
into two engine pools. Ranks 0..P-1 compute prompts and their first tokens; ranks P..P+D-1
continue them, their prompts' KV blocks handed over through the KV connector. The ranks are
dp ranks in every other respect (placement, handshake, coordinator, health), so the axis is
data parallel with a role per rank: the API server routes each request to a prefill rank,
then to a decode rank (serve/handoff.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from parashift.strategies.composition import AxesComposition
from parashift.strategies.data import DataParallel
from parashift.strategies.layout import ProcessPlan


class PrefillDecodePools(DataParallel):
    """`size` = prefill + decode engines; the spec grammar writes it `pPxdD`. At another size
    (elastic dp) the prefill pool stays and the decode pool takes the rest: ranks come and go
    at the top, which is the decode pool's end."""

    def __init__(self, size: int = 2, prefill: int = 1, decode: int | None = None):
        decode = size - prefill if decode is None else decode
        if prefill < 1 or decode < 1 or prefill + decode != size:
            raise ValueError(f"prefill/decode pools need p >= 1 and d >= 1 summing to the "
                             f"engine count (p{prefill}xd{decode}, {size} engines)")
        super().__init__(size)
        self.prefill, self.decode = prefill, decode

    def options(self) -> dict[str, Any]:
        return {"prefill": self.prefill}

    @property
    def token(self) -> str:
        return f"p{self.prefill}xd{self.decode}"

    def processes(self, plan: ProcessPlan) -> ProcessPlan:
        plan = super().processes(plan)
        return dataclasses.replace(plan, prefill_engines=self.prefill)


def engine_pool(spec: AxesComposition, rank: int) -> str | None:
    """"prefill" or "decode" for a rank of prefill/decode pools; None without pools."""
    prefill = spec.processes().prefill_engines
    return pool_of(rank, prefill) if prefill else None


def pool_of(rank: int, prefill_engines: int) -> str:
    return "prefill" if rank < prefill_engines else "decode"


def pools_from_sizes(prefill: int, decode: int) -> PrefillDecodePools:
    return PrefillDecodePools(prefill + decode, prefill=prefill, decode=decode)

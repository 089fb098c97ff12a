"""What every MoE model adds to its dense base: one expert dispatcher shared by its sparse
blocks, which the model runner starts each step with (`begin_step`)."""

from __future__ import annotations

from typing import Any

from parashift.distributed.expert_dispatch import ExpertDispatcher
from parashift.distributed.parallel_context import ParallelContext


class MoEModel:
    dispatcher: ExpertDispatcher | None = None

    def expert_dispatcher(self, parallel: ParallelContext) -> ExpertDispatcher:
        if self.dispatcher is None:
            self.dispatcher = ExpertDispatcher(parallel.group("ep"))
        return self.dispatcher


def is_sparse_layer(cfg: Any, layer_index: int) -> bool:
    """Qwen-MoE's rule: layers in `mlp_only_layers` stay dense, and only every
    `decoder_sparse_step`-th layer is sparse."""
    if layer_index in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return cfg.num_experts > 0 and (layer_index + 1) % step == 0

"""The pipeline bubble `plan` predicts: with c requests running, the engine keeps
b = min(c, pp) batches in flight (a request is in one batch at a time). Each stage's share of
a step is its compute: its decoder layers for every token, plus the LM head for every sampled
row on the last stage. b batches cycling through the stages take
max(sum of the stages' work, b x the slowest stage's) per round; a stage idles for the rest.
The bubble is that idle share, averaged over the stages. Engine overheads are left out:
`parashift bench pipeline` measures the real bubble and asks `plan` for this one."""

from __future__ import annotations

from parashift.strategies.layout import DeviceCost


def stage_work(cost: DeviceCost, tokens_per_sampled_row: float) -> float:
    """A stage's multiply-adds per sampled row (the embedding is a lookup, not a GEMM)."""
    head = cost.vocab_rows * cost.hidden_size if cost.has_final_norm else 0
    gemm = cost.weight_params() - head - (cost.vocab_rows * cost.hidden_size
                                          if cost.has_embedding else 0)
    return tokens_per_sampled_row * gemm + head


def bubble(works: list[float], concurrency: int) -> float:
    depth = len(works)
    if depth == 1:
        return 0.0
    in_flight = min(concurrency, depth)
    cycle = max(sum(works), in_flight * max(works))
    return sum(1 - in_flight * w / cycle for w in works) / depth


def pipeline_bubbles(costs: list[DeviceCost], prompt_tokens: int, levels: tuple[int, ...]
                     ) -> dict[str, dict[str, float]]:
    """The bubble at each concurrency of `levels`, for decode (one token per sampled row) and
    for prefill (`prompt_tokens` per sampled row)."""
    out = {}
    for workload, tokens in (("decode", 1), ("prefill", prompt_tokens)):
        works = [stage_work(c, tokens) for c in costs]
        out[workload] = {str(c): round(bubble(works, c), 4) for c in levels}
    return out

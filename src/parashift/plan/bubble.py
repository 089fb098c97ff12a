"""The pipeline bubble `plan` predicts, for a closed loop of c running requests, each of P
prompt tokens and O output tokens (one prefill step, then O - 1 decode steps).

The engine keeps b = min(c, pp) batches in flight and a request is in one of them at a time:
its next step joins the batch formed when its last one returns. So the requests fall into b
lanes (c / b each) that cycle through the stages, and every round each request runs one step:
its prefill with probability q = 1 / O (the share of its steps that is), else one decode
token. A lane's batch costs each stage its decoder layers per token plus, on the last stage,
the LM head per sampled row (one per request and step). A round takes as long as the busiest
stage's share of all lanes, or as one lane's trip through every stage, whichever is longer;
the bubble is the idle share of that, averaged over the stages, and over the rounds (lanes
whose requests happen to be prefilling together make uneven batches: that is most of the
bubble of a prefill-heavy loop, measured 19-31% on SmolLM2 pp2 at 4-32 requests). The
rounds are sampled with a fixed seed, so `plan` answers the same every time. Engine
overheads are left out: `parashift bench pipeline` measures the real bubble beside this one."""

from __future__ import annotations

import random

from parashift.strategies.layout import DeviceCost

ROUNDS = 2000  # sampled rounds when lanes differ from round to round


def stage_works(cost: DeviceCost) -> tuple[float, float]:
    """A stage's multiply-adds per token (its decoder layers) and per sampled row (the LM
    head, last stage only; the embedding is a lookup, not a GEMM)."""
    head = cost.vocab_rows * cost.hidden_size if cost.has_final_norm else 0
    embedding = cost.vocab_rows * cost.hidden_size if cost.has_embedding else 0
    return cost.weight_params() - head - embedding, head


def bubble(works: list[tuple[float, float]], concurrency: int, prompt_tokens: int = 1,
           output_tokens: int = 1) -> float:
    """`works`: each stage's (per token, per sampled row) cost, as `stage_works`."""
    depth = len(works)
    if depth == 1:
        return 0.0
    lanes = [concurrency // depth + (i < concurrency % depth)
             for i in range(min(concurrency, depth))]
    prefill_share = 1.0 / output_tokens
    rng = random.Random(0)
    rounds = 1 if prefill_share in (0.0, 1.0) or prompt_tokens == 1 else ROUNDS
    busy = cycle = 0.0
    for _ in range(rounds):
        batches = []  # [lane][stage] cost of this round
        for size in lanes:
            prefills = (size if prefill_share == 1.0 else
                        sum(rng.random() < prefill_share for _ in range(size)))
            tokens = prefills * prompt_tokens + size - prefills
            batches.append([tokens * per_token + size * per_row
                            for per_token, per_row in works])
        stage_busy = [sum(batch[s] for batch in batches) for s in range(depth)]
        busy += sum(stage_busy) / depth
        cycle += max(max(stage_busy), max(sum(batch) for batch in batches))
    return 1.0 - busy / cycle


def pipeline_bubbles(costs: list[DeviceCost], prompt_tokens: int, output_tokens: int,
                     levels: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """The bubble at each concurrency of `levels`, for decode (steady decoding, one token per
    request and step) and for prefill (requests of `prompt_tokens` in, `output_tokens` out)."""
    works = [stage_works(c) for c in costs]
    return {workload: {str(c): round(bubble(works, c, prompt, output), 4) for c in levels}
            for workload, prompt, output in (("decode", 1, 1),
                                             ("prefill", prompt_tokens, output_tokens))}

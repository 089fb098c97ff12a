"""The pipeline bubble `plan` predicts, for a closed loop of c running requests, each of P
prompt tokens and O output tokens (a new request as soon as one finishes).

The engine's own `Scheduler` forms the batches, with a batch queue as deep as the pipeline,
and a cost model times them: a batch costs each stage its decoder layers per token plus, on
the last stage, the LM head per sampled row. A stage runs its batches in order, each once the
stage before has passed it on; a new batch is formed when the oldest returns, from the
requests not in flight (as `EngineCore._step_with_batch_queue`). So the bubble includes what
the scheduling rule leaves uneven: with few requests some batches are missing, and in a
prefill-heavy loop the prompts that arrive at once make the batches of a round uneven until
the rule's even token share spreads them. The bubble is each stage's idle share of the steady
state (after a warm-up), averaged over the stages. Engine overheads are left out: `parashift
bench pipeline` measures the real bubble beside this one."""

from __future__ import annotations

import collections
import itertools

from parashift.config import SchedulerConfig
from parashift.engine.kv_cache import KVCacheManager
from parashift.engine.request import Request
from parashift.engine.scheduler import Scheduler
from parashift.strategies.layout import DeviceCost
from parashift.types.outputs import ModelRunnerOutput
from parashift.types.sampling_params import SamplingParams

WARMUP_BATCHES, MEASURED_BATCHES = 50, 150  # returned batches before and inside the window
BLOCK_SIZE = 16


def stage_works(cost: DeviceCost) -> tuple[float, float]:
    """A stage's multiply-adds per token (its decoder layers) and per sampled row (the LM
    head, last stage only; the embedding is a lookup, not a GEMM)."""
    head = cost.vocab_rows * cost.hidden_size if cost.has_final_norm else 0
    embedding = cost.vocab_rows * cost.hidden_size if cost.has_embedding else 0
    return cost.weight_params() - head - embedding, head


class _ClosedLoop:
    """c requests in a real Scheduler; each finished one is replaced by a fresh one."""

    def __init__(self, concurrency: int, depth: int, prompt_tokens: int, output_tokens: int,
                 max_num_batched_tokens: int):
        max_len = prompt_tokens + output_tokens
        config = SchedulerConfig(max_num_batched_tokens, max(concurrency, 1), max_len, True)
        blocks = concurrency * (-(-max_len // BLOCK_SIZE) + 1)
        self.scheduler = Scheduler(config, KVCacheManager(blocks, BLOCK_SIZE, False), depth)
        self.params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
        self.prompt = [0] * prompt_tokens
        self.ids = itertools.count()
        for _ in range(concurrency):
            self._add()

    def _add(self) -> None:
        self.scheduler.add_request(Request(str(next(self.ids)), self.prompt, self.params, None))

    def schedule(self):
        """The next batch and its sampled rows (requests whose prompt this step completes)."""
        out = self.scheduler.schedule()
        requests = self.scheduler.requests
        sampled = {rid: 0 for rid in out.num_scheduled_tokens
                   if requests[rid].num_computed_tokens == requests[rid].num_tokens}
        return out, sampled

    def finish(self, out, sampled: dict[str, int]) -> None:
        for done in self.scheduler.update_from_output(out, ModelRunnerOutput(sampled)):
            if done.finish_reason is not None:
                self._add()


def bubble(works: list[tuple[float, float]], concurrency: int, prompt_tokens: int = 1,
           output_tokens: int = 1, max_num_batched_tokens: int = 2048) -> float:
    """`works`: each stage's (per token, per sampled row) cost, as `stage_works`."""
    depth = len(works)
    if depth == 1:
        return 0.0
    loop = _ClosedLoop(concurrency, depth, prompt_tokens, output_tokens,
                       max_num_batched_tokens)
    queue: collections.deque = collections.deque()  # (batch, sampled rows, when it returns)
    stage_free = [0.0] * depth
    spans: list[list[tuple[float, float]]] = []  # every batch's (start, end) on each stage
    now, window_start = 0.0, None
    for returned in range(WARMUP_BATCHES + MEASURED_BATCHES):
        while len(queue) < depth:
            out, sampled = loop.schedule()
            if not out.num_scheduled_tokens:  # everything left is in flight
                break
            ready, span = now, []
            for s, (per_token, per_row) in enumerate(works):
                start = max(ready, stage_free[s])
                ready = stage_free[s] = (start + out.total_num_scheduled_tokens * per_token
                                         + len(sampled) * per_row)
                span.append((start, ready))
            spans.append(span)
            queue.append((out, sampled, ready))
        out, sampled, now = queue.popleft()
        loop.finish(out, sampled)
        if returned == WARMUP_BATCHES:
            window_start = now
    assert window_start is not None and now > window_start
    busy = sum(max(0.0, min(end, now) - max(start, window_start))
               for span in spans for start, end in span)
    return 1.0 - busy / (depth * (now - window_start))


def pipeline_bubbles(costs: list[DeviceCost], prompt_tokens: int, output_tokens: int,
                     levels: tuple[int, ...], max_num_batched_tokens: int = 2048
                     ) -> dict[str, dict[str, float]]:
    """The bubble at each concurrency of `levels`, for decode (steady decoding, one token per
    request and step) and for prefill (requests of `prompt_tokens` in, `output_tokens` out)."""
    works = [stage_works(c) for c in costs]
    return {workload: {str(c): round(bubble(works, c, prompt, output, max_num_batched_tokens), 4)
                       for c in levels}
            for workload, prompt, output in (("decode", 1, 1),
                                             ("prefill", prompt_tokens, output_tokens))}

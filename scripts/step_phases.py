"""Where a batch-32 decode step's time goes, phase by phase: scheduling, the runner's deltas,
input gathering, attention metadata, forward, LM head, sampling metadata, sampler, output
update (per-step medians
of one batch's decode steps). `python scripts/step_phases.py [--sample] [--async]`."""

from __future__ import annotations

import functools
import statistics
import sys
import time

from parashift.engine.llm import LLM
from parashift.engine.request import Request
from parashift.types.sampling_params import SamplingParams

TIMES: dict[str, list[float]] = {}


def timed(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES.setdefault(name, []).append(time.perf_counter() - start)
    return call


def main() -> None:
    sampling = (dict(temperature=0.8, top_p=0.9) if "--sample" in sys.argv
                else dict(temperature=0.0))
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False,
              async_scheduling="--async" in sys.argv)
    core = llm.engine
    runner = core.executor.worker.runner
    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = timed("update", core.scheduler.update_from_output)
    runner.batch.apply = timed("apply deltas", runner.batch.apply)
    runner._prepare_inputs = timed("gather inputs", runner._prepare_inputs)
    runner._forward_stage = timed("forward", runner._forward_stage)
    runner.model.compute_logits = timed("LM head", runner.model.compute_logits)
    runner.sampler = timed("sampler", runner.sampler)
    runner._sampling_metadata = timed("metadata", runner._sampling_metadata)
    runner.backend.build_metadata = timed("attn metadata", runner.backend.build_metadata)
    prompts = [[(100 + 31 * b + 7 * i) % 49000 for i in range(16)] for b in range(32)]

    def batch(n: int) -> list[float]:
        for i, prompt in enumerate(prompts):
            core.add_request(Request(f"r{n}-{i}", prompt, SamplingParams(
                max_tokens=128, ignore_eos=True, **sampling), None))
        steps = []
        while core.has_unfinished_requests():
            start = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - start)
        return steps[1:]  # the decode steps

    batch(0)
    TIMES.clear()
    steps = batch(1)
    print(f"decode step: {statistics.median(steps) * 1e3:.2f} ms (median of {len(steps)})")
    for name, values in TIMES.items():
        print(f"  {name:14s} {statistics.median(values[1:]) * 1e3:7.3f} ms")
    llm.shutdown()


if __name__ == "__main__":
    main()

"""Where a batch-32 decode step's time goes, phase by phase, as exclusive times (a phase's own
time, its sub-phases' taken out), per decode step of one batch: the scheduler, the runner's
bookkeeping, input gathering, the forward's own ops, the fused decoder layers, the LM head, the
sampler. `python scripts/step_phases.py [--sample] [--async]`."""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections import defaultdict

from parashift.engine.llm import LLM
from parashift.engine.request import Request
from parashift.types.sampling_params import SamplingParams

SPENT: defaultdict[str, float] = defaultdict(float)
_open = threading.local()  # per thread (the runner's, with --async): each open phase's
# sub-phase time


def _stack() -> list[float]:
    if not hasattr(_open, "stack"):
        _open.stack = []
    return _open.stack


def timed(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        stack = _stack()
        start = time.perf_counter()
        stack.append(0.0)
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            SPENT[name] += elapsed - stack.pop()
            if stack:
                stack[-1] += elapsed
    return call


def instrument(core) -> None:
    runner = core.executor.worker.runner
    model = runner.model
    phases = [
        (core, "step", "engine step"), (core.scheduler, "schedule", "schedule"),
        (core.scheduler, "update_from_output", "update"),
        (runner, "execute_model", "runner"), (runner.batch, "apply", "apply deltas"),
        (runner, "_run", "runner"), (runner, "_prepare_inputs", "gather inputs"),
        (runner.batch, "advance", "rows that sample"),
        (runner.backend, "build_metadata", "attention metadata"),
        (runner, "_forward_stage", "forward's own ops"),
        (model.embed_tokens, "forward", "embedding"), (model.rotary_emb, "cos_sin", "rotary"),
        (model.norm, "forward", "final norm"), (model, "compute_logits", "LM head"),
        (runner, "_sample", "runner"), (runner, "_sampling_metadata", "sampling metadata"),
        (runner.sampler, "sample", "sampler"), (runner.batch, "resolve_pending", "resolve pending"),
    ]
    for owner, attr, name in phases:
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    if model.fused_layers is not None:  # a class-level call: wrap the class's __call__
        cls = type(model.fused_layers)
        cls.__call__ = timed("fused decoder layers", cls.__call__)


def main() -> None:
    sampling = (dict(temperature=0.8, top_p=0.9) if "--sample" in sys.argv
                else dict(temperature=0.0))
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False,
              async_scheduling="--async" in sys.argv)
    core = llm.engine
    instrument(core)
    prompts = [[(100 + 31 * b + 7 * i) % 49000 for i in range(16)] for b in range(32)]

    def batch(n: int) -> tuple[int, float]:
        for i, prompt in enumerate(prompts):
            core.add_request(Request(f"r{n}-{i}", prompt, SamplingParams(
                max_tokens=128, ignore_eos=True, **sampling), None))
        core.step()  # the prefill
        SPENT.clear()
        steps, start = 0, time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
            steps += 1
        return steps, time.perf_counter() - start

    batch(0)
    steps, seconds = batch(1)
    print(f"decode step: {seconds / steps * 1e3:.2f} ms (mean of {steps}); exclusive times:")
    for name, total in sorted(SPENT.items(), key=lambda kv: -kv[1]):
        print(f"  {name:22s} {total / steps * 1e3:7.3f} ms")
    llm.shutdown()


if __name__ == "__main__":
    main()

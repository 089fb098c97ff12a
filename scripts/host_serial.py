"""The host's serial time of a batch-32 decode step: the step's wall time minus the forward,
the LM head and the sampler (what `bench latency --breakdown` reports, without its profiler
pass), median per step of three batches of 32 requests of 16 + 128 tokens after a warm-up
batch. Runs on an older checkout too (`PYTHONPATH=<tree>/src:<tree>`), for before/after pairs.

    python scripts/host_serial.py [MODEL] [--sample]     # --sample: temperature 0.8, top-p 0.9
"""

from __future__ import annotations

import statistics
import sys
import time

from parashift.engine.llm import LLM
from parashift.engine.request import Request
from parashift.types.sampling_params import SamplingParams


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sampling = (dict(temperature=0.8, top_p=0.9) if "--sample" in sys.argv
                else dict(temperature=0.0))
    llm = LLM(args[0] if args else None, dtype="bfloat16", enable_prefix_caching=False)
    core = llm.engine
    runner = core.executor.worker.runner
    device_time = [0.0]

    # ModelRunner.device_timer's count (what bench/breakdown.py reads), by hand: the older
    # checkouts this compares with lack it
    def timed(fn):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                device_time[0] += time.perf_counter() - start
        return call

    runner._forward_stage = timed(runner._forward_stage)
    runner.model.compute_logits = timed(runner.model.compute_logits)
    if hasattr(runner.sampler, "sample"):
        runner.sampler.sample = timed(runner.sampler.sample)
    else:  # a checkout before Sampler.sample
        runner.sampler = timed(runner.sampler)
    prompts = [[(100 + 31 * b + 7 * i) % 49000 for i in range(16)] for b in range(32)]
    medians = []
    for n in range(4):
        for i, prompt in enumerate(prompts):
            core.add_request(Request(f"r{n}-{i}", prompt, SamplingParams(
                max_tokens=128, ignore_eos=True, **sampling), None))
        core.step()  # the prefill
        host, wall = [], []
        while core.has_unfinished_requests():
            device_time[0] = 0.0
            start = time.perf_counter()
            core.step()
            wall.append(time.perf_counter() - start)
            host.append(wall[-1] - device_time[0])
        if n:  # the first batch warms up
            medians.append((statistics.median(host), statistics.median(wall)))
    print(" ".join(f"host {h * 1e3:.3f} ms step {w * 1e3:.2f} ms" for h, w in medians))
    print(f"host serial time per step, median of {len(medians)} batches: "
          f"{statistics.median(h for h, _ in medians) * 1e3:.3f} ms")
    llm.shutdown()


if __name__ == "__main__":
    main()

"""`parashift plan --auto`: every strategy the devices allow, planned and ranked by the
roofline estimate for the objective."""

from __future__ import annotations

from parashift.plan.estimate import Plan, PlanSettings, make_plan
from parashift.plan.shape import ModelShape
from parashift.strategies.spec import StrategySpec


def candidate_specs(shape: ModelShape, devices: int) -> list[StrategySpec]:
    specs = []
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            specs.append(StrategySpec.from_sizes(dp=dp, tp=tp, pp=pp))
            if shape.is_moe and dp * tp > 1:
                specs.append(StrategySpec.from_sizes(dp=dp, tp=tp, pp=pp, ep=True))
    return specs


def rank_plans(shape: ModelShape, settings: PlanSettings, objective: str = "throughput",
               slo_tpot_ms: float | None = None) -> tuple[list[Plan], str]:
    """Plans that fit, best first, and why the first one wins."""
    plans = [make_plan(shape, spec, settings) for spec in candidate_specs(shape,
                                                                          settings.devices)]
    fitting = [p for p in plans if p.fits and p.estimate]
    if slo_tpot_ms is not None:
        within = [p for p in fitting if p.estimate["tpot_ms"] <= slo_tpot_ms]
        fitting = within or fitting
    if objective == "latency":  # one sequence alone: the fastest a token can come
        fitting.sort(key=lambda p: (p.estimate["tpot_single_ms"],
                                    -p.estimate["decode_tokens_per_s"]))
    else:
        fitting.sort(key=lambda p: (-p.estimate["decode_tokens_per_s"], p.estimate["tpot_ms"]))
    if not fitting:
        return [], "no strategy fits: " + (plans[0].errors[0] if plans and plans[0].errors
                                           else "no candidates")
    best = fitting[0]
    why = (f"{best.spec}: the lowest time per output token for one sequence "
           f"({best.estimate['tpot_single_ms']:.2f} ms)" if objective == "latency" else
           f"{best.spec}: the highest decode throughput "
           f"({best.estimate['decode_tokens_per_s']:,.0f} tok/s)")
    if slo_tpot_ms is not None:
        meets = best.estimate["tpot_ms"] <= slo_tpot_ms
        why += (f" within the {slo_tpot_ms:g} ms TPOT SLO" if meets
                else f"; nothing meets the {slo_tpot_ms:g} ms TPOT SLO")
    runnable = [p for p in fitting if p.runnable]
    if runnable and runnable[0] is not best:
        why += f"; the best that runs today is {runnable[0].spec}"
    return fitting, why


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]

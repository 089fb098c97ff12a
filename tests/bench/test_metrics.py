"""The bench arithmetic on synthetic timelines, checked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from parashift.bench.metrics import RequestRecord, distribution, parse_goodput, summarize
from parashift.bench.serve_client import arrival_times


def record(ttft, gaps, prompt_len=10, error=None):
    """A request whose first token came at `ttft` s and the next ones after `gaps`."""
    r = RequestRecord(prompt_len, len(gaps) + 1, ttft=ttft, itl=list(gaps), error=error)
    if error is None:
        r.e2e = ttft + sum(gaps)
        r.generated = len(gaps) + 1
    return r


def test_tpot_is_the_decode_time_over_the_tokens_after_the_first():
    r = record(0.5, [0.1, 0.2, 0.3])  # 4 tokens, e2e 1.1 s
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert record(0.5, []).tpot is None  # one token: no time per output token
    assert record(0.5, [0.1], error="HTTP 500: boom").tpot is None


def test_summary_of_a_known_timeline():
    records = [record(0.1, [0.05] * 9), record(0.3, [0.1] * 4),
               record(0.2, [], error="HTTP 400: bad")]
    s = summarize(records, duration=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["failure_reasons"] == {"HTTP N: bad": 1}
    assert s["output_tokens"] == 15 and s["input_tokens"] == 20
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(7.5)
    assert s["total_token_throughput"] == pytest.approx(17.5)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx((50.0 + 100.0) / 2)
    assert s["itl_ms"]["median"] == pytest.approx(50.0)  # 9 gaps of 50 ms, 4 of 100 ms
    assert s["e2e_ms"]["max"] == pytest.approx(700.0)


def test_percentiles_match_numpy():
    values = list(np.random.default_rng(0).exponential(1.0, 1001))
    d = distribution(values)
    assert d["median"] == pytest.approx(1e3 * np.median(values))
    assert d["p90"] == pytest.approx(1e3 * np.percentile(values, 90))
    assert d["p99"] == pytest.approx(1e3 * np.percentile(values, 99))
    assert distribution([]) == {}


def test_goodput_counts_requests_within_every_slo():
    fast, slow_start, slow_decode = record(0.1, [0.01] * 5), record(0.9, [0.01]), record(
        0.1, [0.2, 0.2])
    s = summarize([fast, slow_start, slow_decode, record(0.1, [], error="x")], 4.0,
                  parse_goodput(["ttft:500", "tpot:50"]))
    assert s["goodput"]["requests"] == 1 and s["goodput"]["request_rate"] == pytest.approx(0.25)
    assert summarize([slow_start], 1.0, {"e2e": 2000})["goodput"]["requests"] == 1


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "speed:5", "tpot:fast", "e2e:-1"])
def test_bad_goodput_names_the_flag(bad):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput([bad])


def test_arrivals_poisson_mean_and_burst_at_inf():
    times = arrival_times(20001, rate=4.0, burstiness=1.0, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] / 20000 == pytest.approx(0.25, rel=0.03)
    gaps = np.diff(times)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    regular = np.diff(arrival_times(20001, 4.0, burstiness=4.0, seed=1))
    assert np.std(regular) / np.mean(regular) == pytest.approx(0.5, rel=0.05)  # 1/sqrt(4)
    assert arrival_times(5, math.inf, 1.0, 0) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_times(5, 0.0, 1.0, 0)

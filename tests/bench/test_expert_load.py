"""`bench serve`'s expert load (bench/expert_load.py): the series read from a parashift
server's /metrics, the run's share of them per engine and expert, and the lines it prints."""

from __future__ import annotations

from parashift.bench import expert_load
from parashift.bench.expert_load import format_load

METRICS = """# HELP parashift_expert_routed_tokens ...
parashift_expert_routed_tokens{engine="dp0",expert="0"} 10.0
parashift_expert_routed_tokens{engine="dp0",expert="1"} 4.0
parashift_expert_routed_tokens{engine="dp1",expert="1"} 7.0
parashift_lockstep_in_wave{engine="dp0"} 0.0
"""


def test_the_runs_load_per_engine_and_expert(monkeypatch):
    monkeypatch.setattr(expert_load, "_metrics", lambda url, key: METRICS)
    before = expert_load.scrape("http://127.0.0.1:1/v1")
    assert before == {("dp0", 0): 10.0, ("dp0", 1): 4.0, ("dp1", 1): 7.0}
    after = {("dp0", 0): 30.0, ("dp0", 1): 4.0, ("dp1", 0): 5.0, ("dp1", 1): 22.0}
    load = expert_load.expert_load(before, after)
    assert load == {"dp0": [20, 0], "dp1": [5, 15]}
    text = format_load(load)
    assert "dp0   imbalance  2.00  20 0" in text
    assert "all   imbalance  1.25  25 15" in text


def test_a_server_without_the_series_shows_nothing(monkeypatch):
    assert expert_load._metrics("file:///etc/passwd", None) == ""  # http(s) only
    monkeypatch.setattr(expert_load, "_metrics", lambda url, key: "vllm_whatever 1\n")
    assert expert_load.scrape("http://127.0.0.1:1") == {}
    assert expert_load.expert_load({}, {}) == {} and format_load({}) == ""

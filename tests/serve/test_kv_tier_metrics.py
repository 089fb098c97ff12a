"""/metrics of the KV tiers: an engine's tier counts, per tier and direction."""

from __future__ import annotations

from parashift.serve.metrics import Metrics
from parashift.types.outputs import KVTierStats, SchedulerStats
from parashift.wire import protocol as p


def test_tier_counts_are_rendered_per_engine_and_tier():
    metrics = Metrics()
    tiers = KVTierStats(host_hit_blocks=12, disk_hit_blocks=6, loaded_bytes=1 << 20,
                        stored_bytes=2 << 20, host_loads=2, host_load_seconds=0.25,
                        disk_loads=1, disk_load_seconds=0.5, failed_loads=1)
    metrics.on_engine_outputs(p.EngineOutputs(1, [], SchedulerStats(0, 0, 0.0, kv_tiers=tiers)))
    text = metrics.render().decode()
    for line in ('parashift_kv_tier_hit_blocks{engine="dp1",tier="host"} 12.0',
                 'parashift_kv_tier_hit_blocks{engine="dp1",tier="disk"} 6.0',
                 'parashift_kv_tier_bytes{direction="load",engine="dp1"} 1.048576e+06',
                 'parashift_kv_tier_bytes{direction="store",engine="dp1"} 2.097152e+06',
                 'parashift_kv_tier_loads{engine="dp1",tier="disk"} 1.0',
                 'parashift_kv_tier_load_seconds{engine="dp1",tier="host"} 0.25',
                 'parashift_kv_tier_failed_loads{engine="dp1"} 1.0'):
        assert line in text, line


def test_an_engine_without_tiers_renders_none():
    metrics = Metrics()
    metrics.on_engine_outputs(p.EngineOutputs(0, [], SchedulerStats(0, 0, 0.0)))
    assert 'parashift_kv_tier_hit_blocks{' not in metrics.render().decode()

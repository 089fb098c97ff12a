"""Prometheus metrics of one API server (its own registry, served at GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from parashift.types.outputs import KVTierStats
from parashift.wire import protocol as p

# Expert-parallel lockstep, per engine (counters since it started): stats field -> (metric, help)
_LOCKSTEP = {
    "num_dummy_steps": ("parashift_lockstep_dummy_steps",
                        "Steps an engine ran with nothing to schedule so that its "
                        "expert-parallel group's collectives had it"),
    "num_waves": ("parashift_lockstep_waves", "Lockstep waves an engine has ended"),
    "in_wave": ("parashift_lockstep_in_wave",
                "1 while an engine is in a lockstep wave (as of its last load report)"),
    "step_seconds": ("parashift_lockstep_step_seconds",
                     "Seconds an engine spent in lockstep steps"),
    "dispatch_seconds": ("parashift_expert_dispatch_seconds",
                         "Seconds of those steps in the expert dispatch and combine (waiting "
                         "for slower engines included)"),
    "num_prefill_held_steps": ("parashift_lockstep_prefill_held_steps",
                               "Lockstep steps in which an engine held prefill work back "
                               "(--prefill-schedule-interval)"),
}
MAX_EXPERTS = 1024  # series per engine at most (DeepSeek-V3 has 256 experts)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("parashift_requests", "Finished HTTP generation requests",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("parashift_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("parashift_generation_tokens", "Generated tokens",
                                         registry=r)
        self.ttft = Histogram("parashift_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("parashift_time_per_output_token_seconds",
                              "Time per output token after the first", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("parashift_e2e_request_latency_seconds", "End-to-end latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("parashift_num_requests_running", "Running requests", ["engine"],
                             registry=r)
        self.waiting = Gauge("parashift_num_requests_waiting", "Waiting requests", ["engine"],
                             registry=r)
        self._scale_metrics(r)
        self.load_tokens = Gauge("parashift_engine_load_tokens", "The rank's work in tokens as "
                                 "the DP router sees it: prompt tokens still to compute "
                                 "(prefill), output tokens still allowed (output)",
                                 ["engine", "kind"], registry=r)
        self.kv_usage = Gauge("parashift_kv_cache_usage_ratio", "Share of KV blocks in use",
                              ["engine"], registry=r)
        self._prefix_cache_gauges(r)
        self.routed = Counter("parashift_engine_requests", "Requests routed to each engine",
                              ["engine"], registry=r)
        self._tier_gauges(r)
        self.preemptions = Gauge("parashift_num_preemptions",
                                 "Requests an engine preempted (since it started)", ["engine"],
                                 registry=r)
        self.lockstep = {field: Gauge(name, doc, ["engine"], registry=r)
                         for field, (name, doc) in _LOCKSTEP.items()}
        self.expert_tokens = Gauge(
            "parashift_expert_routed_tokens", "An expert-parallel engine's own tokens routed "
            "to each expert (global id), summed over the MoE layers (since it started; as of "
            "its last wave's end)", ["engine", "expert"], registry=r)
        # Which API server answered this scrape (each has its own registry), and every HTTP
        # answer of the generation endpoints by status: a client can count its requests here.
        self.api_server = Gauge("parashift_api_server", "1, labelled with this API server's "
                                "index", ["index"], registry=r)
        self.responses = Counter("parashift_http_responses", "Answers of /v1/completions and "
                                 "/v1/chat/completions by HTTP status (499: the client left)",
                                 ["code"], registry=r)
        self.failovers = Counter(
            "parashift_request_failovers", "Requests whose engine died: re-sent to a live rank "
            "before their first token (resent), or ended with the error (failed)",
            ["outcome"], registry=r)
        self.sleep_level = Gauge("parashift_engine_sleep_level", "0 awake; 1 KV cache freed; "
                                 "2 weights freed too", ["engine"], registry=r)
        self.sleep_released = Gauge("parashift_engine_sleep_released_bytes", "Memory the "
                                    "engine's current sleep released (RSS on CPU, device "
                                    "memory on GPU; 0 awake)", ["engine"], registry=r)
        self.engine_up = Gauge("parashift_engine_up", "1 while the engine is alive", ["engine"],
                               registry=r)

    def _prefix_cache_gauges(self, r: CollectorRegistry) -> None:
        self.prefix_hit_rate = Gauge("parashift_prefix_cache_hit_rate",
                                     "Prompt tokens served by the prefix cache / queried",
                                     ["engine"], registry=r)
        # The engine's own totals since it started: what usage.prompt_tokens_details reports.
        self.prefix_queried = Gauge("parashift_prefix_cache_queried_tokens",
                                    "Prompt tokens looked up in the prefix cache (since the "
                                    "engine started)", ["engine"], registry=r)
        self.prefix_hits = Gauge("parashift_prefix_cache_hit_tokens",
                                 "Prompt tokens the prefix cache served (since the engine "
                                 "started)", ["engine"], registry=r)

    def _tier_gauges(self, r: CollectorRegistry) -> None:
        """KV tiers: the engine's counts since it started (set, as the prefix cache's are)."""
        self.tier_hits = Gauge("parashift_kv_tier_hit_blocks", "KV blocks loaded from a tier "
                               "instead of computed", ["engine", "tier"], registry=r)
        self.tier_bytes = Gauge("parashift_kv_tier_bytes", "Bytes moved between the KV cache "
                                "and the host tier", ["engine", "direction"], registry=r)
        self.tier_loads = Gauge("parashift_kv_tier_loads", "Loads that ended with their blocks "
                                "in the KV cache (disk: some read from disk)", ["engine", "tier"],
                                registry=r)
        self.tier_load_seconds = Gauge("parashift_kv_tier_load_seconds", "Summed time from a "
                                       "load's lookup to its blocks in the KV cache",
                                       ["engine", "tier"], registry=r)
        self.tier_failed = Gauge("parashift_kv_tier_failed_loads", "Loads given up (the blocks "
                                 "were computed instead)", ["engine"], registry=r)

    def _scale_metrics(self, r: CollectorRegistry) -> None:
        """Elastic data parallel's (serve/engine_routes.py scale)."""
        self.dp_size = Gauge("parashift_data_parallel_size", "Ranks in the deployment (those "
                             "serving, starting, draining or down)", registry=r)
        self.scale_events = Counter("parashift_scale_requests_total", "Scale requests this "
                                    "API server passed on, by outcome (ok, refused, failed)",
                                    ["outcome"], registry=r)

    def on_engine_outputs(self, msg: p.EngineOutputs) -> None:
        engine, s = f"dp{msg.rank}", msg.stats
        self.running.labels(engine).set(s.num_running)
        self.waiting.labels(engine).set(s.num_waiting)
        self.kv_usage.labels(engine).set(s.kv_cache_usage)
        self.preemptions.labels(engine).set(s.num_preemptions)
        self.prefix_queried.labels(engine).set(s.prefix_cache_queried_tokens)
        self.prefix_hits.labels(engine).set(s.prefix_cache_hit_tokens)
        if s.prefix_cache_queried_tokens:
            self.prefix_hit_rate.labels(engine).set(
                s.prefix_cache_hit_tokens / s.prefix_cache_queried_tokens)
        if s.kv_tiers is not None:
            self._on_tier_stats(engine, s.kv_tiers)

    def _on_tier_stats(self, engine: str, t: KVTierStats) -> None:
        for tier, hits, loads, seconds in (
                ("host", t.host_hit_blocks, t.host_loads, t.host_load_seconds),
                ("disk", t.disk_hit_blocks, t.disk_loads, t.disk_load_seconds),
                ("remote", t.remote_hit_blocks, t.remote_loads, t.remote_load_seconds)):
            self.tier_hits.labels(engine, tier).set(hits)
            self.tier_loads.labels(engine, tier).set(loads)
            self.tier_load_seconds.labels(engine, tier).set(seconds)
        self.tier_bytes.labels(engine, "load").set(t.loaded_bytes)
        self.tier_bytes.labels(engine, "store").set(t.stored_bytes)
        self.tier_failed.labels(engine).set(t.failed_loads)

    def on_load_vector(self, vector: p.LoadVector) -> None:
        for load in vector.loads:
            engine = f"dp{load.rank}"
            self.running.labels(engine).set(load.stats.num_running)
            self.waiting.labels(engine).set(load.stats.num_waiting)
            self.kv_usage.labels(engine).set(load.stats.kv_cache_usage)
            self.sleep_level.labels(engine).set(load.sleep_level)
            self.load_tokens.labels(engine, "prefill").set(load.stats.prefill_tokens_left)
            self.load_tokens.labels(engine, "output").set(load.stats.output_tokens_left)
            self.sleep_released.labels(engine).set(load.sleep_released_bytes)
            if load.wave is not None:
                for field, gauge in self.lockstep.items():
                    gauge.labels(engine).set(float(getattr(load.wave, field)))
                for expert, tokens in enumerate(load.wave.expert_tokens[:MAX_EXPERTS]):
                    self.expert_tokens.labels(engine, str(expert)).set(tokens)

    def observe_request(self, status: str, num_prompt: int, num_output: int,
                        arrival: float, first_token: float | None, finished: float) -> None:
        self.requests.labels(status).inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(num_output)
        self.e2e.observe(finished - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_output > 1:
                self.tpot.observe((finished - first_token) / (num_output - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

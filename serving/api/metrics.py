"""Prometheus metrics of the HTTP server.

Counters and histograms are updated by the request handlers on the event loop; engine gauges and counters are
read at scrape time from `AsyncEngine.live_stats()`: queue length and running sequences as they are now
(including submissions the engine thread has not applied yet, so a long step does not hide a queue), KV blocks,
prefix-cache hit rate, preemptions, steps and failed steps from the snapshot published after every step. A
scrape never waits for the engine. Each server owns its own registry, so several servers (tests) can live in
one process.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.api.async_engine import EngineStats, RequestStream

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "pallas_serve"

# Seconds; CPU runs of a 135M model sit around 0.05-5 s, GPU runs far below, so the buckets span both.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class _EngineCollector:
    """Gauges and engine counters computed from the latest EngineStats at scrape time, and the engine thread's
    liveness read from the bridge (AsyncEngine) itself."""

    def __init__(self, stats: Callable[[], EngineStats | None], engine=None):
        self._stats = stats
        self._engine = engine

    def collect(self):
        s = self._stats() or EngineStats()
        gauges = (
            ("queue_length", "Requests waiting for a running slot.", s.num_waiting),
            ("running_sequences", "Sequences being generated.", s.num_running),
            ("kv_blocks_used", "KV blocks referenced (by requests or the prefix cache).", s.kv_blocks_used),
            ("kv_blocks_free", "KV blocks on the free list.", s.kv_blocks_free),
            ("kv_blocks_cached", "KV blocks held by the prefix cache.", s.kv_blocks_cached),
            (
                "kv_blocks_in_requests",
                "KV blocks used beyond the prefix cache's own (0 when idle).",
                max(0, s.kv_blocks_used - s.kv_blocks_cached),
            ),
            (
                "prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache / prompt tokens looked up.",
                s.prefix_hit_rate,
            ),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        counters = (  # exposed with the _total suffix
            ("preemptions", "Preemptions since start.", s.num_preemptions),
            ("engine_steps", "Engine steps since start.", s.num_steps),
            ("engine_step_failures", "Engine steps that raised since start.", s.num_step_failures),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        yield from _speculative_families(s.speculative)
        yield from _router_families(s.router_tokens)
        yield from _liveness_families(self._engine)


def _liveness_families(engine):
    """Age of the last engine step, how long the loop has had work without progress, parked requests and compiles
    on the engine thread (none expected while serving): what /health judges a stall by, for dashboards."""
    if engine is None or not hasattr(engine, "last_step_age"):
        return
    age = engine.last_step_age()
    yield GaugeMetricFamily(
        f"{PREFIX}_engine_last_step_age_seconds",
        "Seconds since the last engine step ended (-1 before the first).",
        value=-1.0 if age is None else age,
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_engine_stalled_seconds",
        "Seconds the engine loop has had work without completing a step, chunk or command (0 when progressing).",
        value=engine.stalled_for(),
    )
    yield GaugeMetricFamily(
        f"{PREFIX}_requests_waiting_for_compile",
        "Requests parked until their block-table width is compiled in the background.",
        value=engine.num_parked,
    )
    yield CounterMetricFamily(
        f"{PREFIX}_engine_thread_compiles",
        "XLA compilations on the engine thread since it became ready (0 expected: nothing compiles while serving).",
        value=engine.compiles_while_serving,
    )


_SPEC_COUNTERS = (  # SpecDecoder.metrics() key, metric name, help; exposed with the _total suffix, per method
    ("passes", "spec_verify_passes", "Verify passes of rows with draft tokens, by speculative method."),
    ("drafted", "spec_draft_tokens", "Draft tokens verified, by speculative method."),
    ("accepted", "spec_accepted_tokens", "Draft tokens accepted, by speculative method."),
    ("emitted", "spec_emitted_tokens", "Tokens emitted by verify passes (accepted + one each), by method."),
)
_SPEC_GAUGES = (
    ("acceptance_rate", "spec_acceptance_rate", "Accepted / drafted tokens since start, by speculative method."),
    ("mean_emitted_per_pass", "spec_mean_emitted_per_pass", "Tokens emitted per verify pass since start, by method."),
)


def _speculative_families(per_method: dict):
    """Acceptance counters and rates of speculative decoding, one sample per method (none while it is off)."""
    if not per_method:
        return
    for families, kind in ((_SPEC_COUNTERS, CounterMetricFamily), (_SPEC_GAUGES, GaugeMetricFamily)):
        for key, name, doc in families:
            family = kind(f"{PREFIX}_{name}", doc, labels=["method"])
            for method, m in per_method.items():
                family.add_metric([method], m[key])
            yield family


def _router_families(router_tokens):
    """MoE router load (none for a dense model): tokens routed per layer and expert, and per layer the busiest
    expert's share over the mean (1.0 = perfectly balanced; E = every token on one expert)."""
    if router_tokens is None:
        return
    routed = CounterMetricFamily(
        f"{PREFIX}_moe_routed_tokens",
        "Token-to-expert assignments (top-k each) by layer and expert.",
        labels=["layer", "expert"],
    )
    imbalance = GaugeMetricFamily(
        f"{PREFIX}_moe_expert_load_imbalance", "Busiest expert's assignments / the mean, by layer.", labels=["layer"]
    )
    for layer, counts in enumerate(router_tokens):
        counts = [int(c) for c in counts]
        for expert, c in enumerate(counts):
            routed.add_metric([str(layer), str(expert)], c)
        total = sum(counts)
        imbalance.add_metric([str(layer)], max(counts) * len(counts) / total if total else 1.0)
    yield routed
    yield imbalance


class ServerMetrics:
    """The server's metrics and their Prometheus text rendering.

    Args:
      stats: returns the engine's latest EngineStats (or None before it is loaded).
      engine: the engine bridge, for the liveness gauges (AsyncEngine; None or other bridges: none).
    """

    def __init__(self, stats: Callable[[], EngineStats | None], engine=None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "HTTP requests by endpoint and status code.", ["endpoint", "status"], registry=r
        )
        self.finished = Counter(
            f"{PREFIX}_sequences_finished", "Finished sequences by finish reason.", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of accepted requests.", registry=r)
        self.generated_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Arrival to first token, per sequence.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per sequence.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Arrival to last token, per sequence.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(stats, engine))

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_stream(
        self, stream: RequestStream, num_prompt_tokens: int, finish_reasons: dict[str, str | None]
    ) -> None:
        """Records latency and token counts of a stream's sequences once it has ended (any way)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        for rid in stream.request_ids:
            n = stream.num_output_tokens.get(rid, 0)
            self.generated_tokens.inc(n)
            self.finished.labels(reason=finish_reasons.get(rid) or "abort").inc()
            first, end = stream.first_token_at.get(rid), stream.finished_at.get(rid)
            if first is not None:
                self.ttft.observe(first - stream.arrival)
            if end is not None and first is not None:
                self.e2e.observe(end - stream.arrival)
                if n > 1:
                    self.tpot.observe((end - first) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

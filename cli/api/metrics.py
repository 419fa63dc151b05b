"""quill serve --metrics: GET /metrics in Prometheus's text format, written by prometheus_client
(its reference implementation) from a registry of this server's own, so that two servers in one
process (the tests) never share counts.

Counted as requests finish: requests by route, model and HTTP status; prompt, cached and
generated tokens; time to first token and decode speed. Read from the pool at each scrape:
models loaded and their planned memory, slots (busy and all), requests waiting, loads and
unloads (by why).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from cli.api.pool import ModelPool
    from cli.engine.events import StreamEvent

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds to a first token: a short prompt on a GPU (10 ms) to a long one on a laptop (minutes).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Tokens per second of decode: a 70B model on a CPU (1) to a small one on a GPU (500+).
DECODE_BUCKETS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 250, 500, 1000)


class ServerMetrics:
    """The server's counters and histograms, and the pool's gauges read at each scrape."""

    def __init__(self, pool: ModelPool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "quill_requests", "HTTP requests answered, by route, model and status code",
            ["route", "model", "status"], registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = self._token_counter("prompt", "Prompt tokens of finished requests")
        self.cached_tokens = self._token_counter(
            "cached_prompt", "Prompt tokens reused from a cache (memory or disk), not prefilled"
        )
        self.generated_tokens = self._token_counter("generated", "Tokens generated")
        self.ttft = Histogram(
            "quill_time_to_first_token_seconds",
            "From a request's arrival to its first token (queue wait and prefill)",
            ["model"], buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.decode_speed = Histogram(
            "quill_decode_tokens_per_second", "Each finished generation's decode speed",
            ["model"], buckets=DECODE_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(PoolCollector(pool))

    def _token_counter(self, kind: str, documentation: str) -> Counter:
        return Counter(f"quill_{kind}_tokens", documentation, ["model"], registry=self.registry)

    def request(self, route: str, model: str, status: int) -> None:
        self.requests.labels(route, model, str(status)).inc()

    def generation(self, model: str, last: StreamEvent, ttft_s: float) -> None:
        """A generation that finished: its last event carries the request's totals."""
        self.prompt_tokens.labels(model).inc(last.prompt_tokens)
        self.cached_tokens.labels(model).inc(last.cached_prompt_tokens)
        self.generated_tokens.labels(model).inc(last.generation_tokens)
        self.ttft.labels(model).observe(max(ttft_s, 0.0))
        if last.generation_tokens > 1:  # one token has no decode time to measure
            self.decode_speed.labels(model).observe(last.decode_tokens_per_s)

    def prompt(self, model: str, tokens: int) -> None:
        """An embedding or rerank request's tokens: prompt tokens, with nothing generated."""
        self.prompt_tokens.labels(model).inc(tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class PoolCollector(Collector):
    """The model pool's state, read when scraped."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        models = self.pool.loaded()
        loaded = GaugeMetricFamily("quill_models_loaded", "Models loaded now")
        loaded.add_metric([], len([m for m in models if m.scheduler is not None]))
        memory = GaugeMetricFamily(
            "quill_model_memory_bytes", "A loaded model's planned memory", labels=["model"]
        )
        slots = GaugeMetricFamily("quill_slots", "A model's slots (sequences)", labels=["model"])
        busy = GaugeMetricFamily("quill_slots_busy", "Slots decoding a request", labels=["model"])
        waiting = GaugeMetricFamily(
            "quill_requests_waiting", "Requests queued for a slot", labels=["model"]
        )
        for model in models:
            scheduler = model.scheduler
            if scheduler is None:
                continue
            memory.add_metric([model.label], model.memory_bytes)
            slots.add_metric([model.label], getattr(scheduler.engine, "parallel", 1))
            busy.add_metric([model.label], scheduler.busy_slots)
            waiting.add_metric([model.label], scheduler.queued)
        loads = CounterMetricFamily("quill_model_loads", "Model loads", labels=["model"])
        for label, count in sorted(self.pool.loads.items()):
            loads.add_metric([label], count)
        unloads = CounterMetricFamily(
            "quill_model_unloads",
            "Model unloads, by why (evicted, keep_alive, stopped, replaced, shutdown)",
            labels=["model", "reason"],
        )
        for (label, reason), count in sorted(self.pool.unloads.items()):
            unloads.add_metric([label, reason], count)
        yield from (loaded, memory, slots, busy, waiting, loads, unloads)

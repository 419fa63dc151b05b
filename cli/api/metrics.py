"""quill serve --metrics: GET /metrics in Prometheus's text format, written by prometheus_client
(its reference implementation) from a registry of this server's own, so that two servers in one
process (the tests) never share counts.

Counted as requests finish: requests by route, model and HTTP status; prompt, cached and
generated tokens; time to first token and decode speed. Read from the pool at each scrape:
models loaded and their planned memory, slots (busy and all), requests waiting, loads and
unloads (by why).

Beside quill's own names, llama-server's (`llamacpp:prompt_tokens_total` and the rest, all
models together, as its one model's), so that a dashboard made for llama-server reads quill.
"""

from __future__ import annotations

import threading
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
        self.llama = LlamaServerMetrics(pool)

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
        self.llama.generation(last)

    def prompt(self, model: str, tokens: int) -> None:
        """An embedding or rerank request's tokens: prompt tokens, with nothing generated."""
        self.prompt_tokens.labels(model).inc(tokens)
        self.llama.prompt(tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry) + self.llama.exposition()


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


class LlamaServerMetrics:
    """llama-server's metrics under its names, written as it writes them: a counter's name
    as it is (prometheus_client would add _total to n_tokens_max, which llama-server's
    dashboards do not read). Its throughput gauges are over the time since the previous scrape,
    as llama-server's are (0 when nothing ran)."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool
        self._lock = threading.Lock()
        # prompt tokens prefilled, cached, prefill seconds, tokens generated, decode seconds
        self.totals = [0, 0, 0.0, 0, 0.0]
        self.n_tokens_max = 0
        self._since: list[float] = [0, 0.0, 0, 0.0]  # totals at the previous scrape

    def generation(self, last: StreamEvent) -> None:
        with self._lock:
            self._add(last.prompt_tokens - last.cached_prompt_tokens, last.cached_prompt_tokens,
                      last.prefill_s, last.generation_tokens, last.decode_s)  # fmt: skip
            self.n_tokens_max = max(self.n_tokens_max, last.prompt_tokens + last.generation_tokens)

    def prompt(self, tokens: int) -> None:
        with self._lock:
            self._add(tokens, 0, 0.0, 0, 0.0)

    def _add(self, *amounts: float) -> None:
        for index, amount in enumerate(amounts):
            self.totals[index] += amount

    def exposition(self) -> bytes:
        lines = []
        for kind, name, documentation, value in self.samples():
            lines += [f"# HELP llamacpp:{name} {documentation}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {float(value)!r}"]  # fmt: skip
        return ("\n".join(lines) + "\n").encode()

    def samples(self) -> Iterator[tuple[str, str, str, float]]:
        """(kind, name, help, value) of each metric."""
        with self._lock:
            prompt, cached, prompt_s, predicted, predicted_s = self.totals
            then = self._since
            self._since = [prompt, prompt_s, predicted, predicted_s]
            n_tokens_max = self.n_tokens_max
        steps, sequences = self._steps()
        counters = (
            ("prompt_tokens_total", "Prompt tokens processed (prefilled)", prompt),
            ("prompt_tokens_cached_total", "Prompt tokens reused from a cache", cached),
            ("prompt_seconds_total", "Prompt processing time", prompt_s),
            ("tokens_predicted_total", "Tokens generated", predicted),
            ("tokens_predicted_seconds_total", "Generation time", predicted_s),
            ("n_decode_total", "llama_decode() calls", steps),
            ("n_tokens_max", "The most tokens one request's context held", n_tokens_max),
            ("spec_decode_num_draft_tokens_total", "Draft tokens (no speculation here)", 0),
            ("spec_decode_num_accepted_tokens_total", "Accepted draft tokens", 0),
            ("spec_decode_num_drafts_total", "Drafts", 0),
        )
        for name, documentation, value in counters:
            yield "counter", name, documentation, value
        loaded = [m.scheduler for m in self.pool.loaded() if m.scheduler is not None]
        gauges = (
            ("prompt_tokens_seconds", "Prompt tokens per second since the last scrape",
             _rate(prompt - then[0], prompt_s - then[1])),
            ("predicted_tokens_seconds", "Generated tokens per second since the last scrape",
             _rate(predicted - then[2], predicted_s - then[3])),
            ("requests_processing", "Requests in a slot", sum(s.busy_slots for s in loaded)),
            ("requests_deferred", "Requests waiting for a slot", sum(s.queued for s in loaded)),
            ("n_busy_slots_per_decode", "Busy slots per llama_decode() call, on average",
             sequences / steps if steps else 0.0),
        )  # fmt: skip
        for name, documentation, value in gauges:
            yield "gauge", name, documentation, value

    def _steps(self) -> tuple[int, int]:
        """Decode steps and the sequences in them, over every scheduler this server ran."""
        steps, sequences = self.pool.retired_steps
        for model in self.pool.loaded():
            scheduler = model.scheduler
            steps += getattr(scheduler, "steps", 0)
            sequences += getattr(scheduler, "sequences_stepped", 0)
        return steps, sequences


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0

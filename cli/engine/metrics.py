"""Turn a stream of engine events into the numbers quill reports (defined in docs/metrics.md)."""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from cli.engine.backend import Backend
from cli.engine.events import StreamEvent


@dataclass(frozen=True)
class RunMetrics:
    load_s: float
    ttft_s: float | None
    prompt_tokens: int
    cached_prompt_tokens: int
    restored_prompt_tokens: int  # of those cached, loaded from the KV store on disk
    prefill_s: float
    prefill_tokens_per_s: float
    generation_tokens: int
    decode_s: float
    decode_tokens_per_s: float
    inter_token_latency_p50_ms: float | None
    inter_token_latency_p95_ms: float | None
    total_s: float
    finish_reason: str | None
    stop_string: str | None
    n_ctx: int
    kv_cache_type: str | None  # None: a server's model, whose KV cache is its own
    kv_cache_bytes: int
    threads: int
    # Cores other processes kept busy at the last look (None: --threads chose the count).
    busy_cores: int | None
    gpu_layers: int
    seed: int | None
    peak_rss_bytes: int | None
    # Reasoning (issue 16): tokens inside a think block, tokens of the answer, and the time from
    # the request to the first answer text (TTFT counts the first token, thinking or not).
    thinking_tokens: int = 0
    answer_tokens: int = 0
    time_to_first_answer_s: float | None = None
    grammar_s: float = 0.0  # in the grammar sampler (structured output); 0 without one
    grammar_resampled: int = 0
    speculation: dict[str, Any] | None = None  # speculative decoding's counts (SpecStats)
    rpc: tuple[str, ...] = ()  # the RPC servers that held the offloaded layers
    # Where each repackable weight type ran, "Q4_K plain, Q6_K repacked" ("": llama.cpp's rule).
    weights: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class MetricsRecorder:
    """Created when the request starts; told of each event just after its text was written."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self._token_times: list[float] = []
        self._token_texts: list[str] = []
        self.last: StreamEvent | None = None
        self.thinking_tokens = 0
        self.first_answer_at: float | None = None

    def observe(self, event: StreamEvent) -> None:
        if event.token is not None:
            self._token_times.append(time.perf_counter())
            self._token_texts.append(event.text)
            self.thinking_tokens += event.thinking
        if event.text and self.first_answer_at is None:
            self.first_answer_at = time.perf_counter()
        self.last = event

    def arrivals(self) -> list[tuple[float, str]]:
        """(milliseconds since the request started, text released) for every generated token."""
        return [
            ((at - self.started) * 1000, text)
            for at, text in zip(self._token_times, self._token_texts, strict=True)
        ]

    def summary(self, engine: Backend, finish_reason: str | None = None) -> RunMetrics:
        """The numbers so far; finish_reason overrides the stream's (e.g. "interrupted")."""
        now = time.perf_counter()
        last, times = self.last, self._token_times
        spec = engine.speculation_stats
        core_load = engine.core_load
        gaps_ms = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
        p50, p95 = _percentiles(gaps_ms)
        kv_type = engine.kv_type_k  # None for a server's model
        if engine.kv_type_k != engine.kv_type_v:
            kv_type = f"{engine.kv_type_k}/{engine.kv_type_v}"
        return RunMetrics(
            load_s=engine.load_s,
            ttft_s=times[0] - self.started if times else None,
            prompt_tokens=last.prompt_tokens if last else 0,
            cached_prompt_tokens=last.cached_prompt_tokens if last else 0,
            restored_prompt_tokens=last.restored_prompt_tokens if last else 0,
            prefill_s=last.prefill_s if last else 0.0,
            prefill_tokens_per_s=last.prefill_tokens_per_s if last else 0.0,
            generation_tokens=last.generation_tokens if last else 0,
            decode_s=last.decode_s if last else 0.0,
            decode_tokens_per_s=last.decode_tokens_per_s if last else 0.0,
            inter_token_latency_p50_ms=p50,
            inter_token_latency_p95_ms=p95,
            total_s=(times[-1] if times else now) - self.started,
            finish_reason=finish_reason or (last.finish_reason if last else None),
            stop_string=last.stop_string if last else None,
            n_ctx=engine.n_ctx,
            kv_cache_type=kv_type,
            kv_cache_bytes=engine.kv_cache_bytes,
            threads=engine.threads,
            busy_cores=core_load.busy_cores if core_load else None,
            gpu_layers=engine.gpu_layers,
            seed=last.seed if last else None,
            peak_rss_bytes=last.peak_rss_bytes if last else None,
            thinking_tokens=self.thinking_tokens,
            answer_tokens=(last.generation_tokens if last else 0) - self.thinking_tokens,
            time_to_first_answer_s=(
                self.first_answer_at - self.started if self.first_answer_at is not None else None
            ),
            grammar_s=last.grammar_s if last else 0.0,
            grammar_resampled=last.grammar_resampled if last else 0,
            speculation=spec.as_dict() if spec is not None else None,
            rpc=engine.rpc,
            weights=engine.weights_placement,
        )


def _percentiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[49], cuts[94]

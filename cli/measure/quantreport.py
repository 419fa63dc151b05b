"""quant-report: what each weight type and KV-cache type costs and buys, measured here.

Every weight type is quantized from one F16 baseline (dequantized first from a quantized source);
with every KV-cache type the same text is scored for perplexity and bench's routines measure
prefill and decode speed. Nothing in a row is looked up.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cli.engine.engine import Engine
from cli.engine.opening import open_engine
from cli.engine.options import LoadOptions
from cli.engine.settings import ModelSettings
from cli.measure.bench import measure_generation, measure_prompt
from cli.measure.perplexity import PerplexityProgress, perplexity
from cli.store.header import header_on_disk
from quant.memory import plan


@dataclass(frozen=True)
class ReportSettings:
    weight_types: tuple[str, ...] = ("f16", "q8_0", "q4_k_m", "q4_0")
    kv_types: tuple[str, ...] = ("f16", "q8_0", "q4_0")
    window: int = 512  # perplexity window, as llama-perplexity's -c
    max_windows: int | None = 8
    prompt_tokens: int = 512
    gen_tokens: int = 64
    repetitions: int = 2
    kv_ctx: int = 4096  # the context the KV bytes are given for
    threads: int | None = None  # None: the free physical cores, measured at each load


@dataclass(frozen=True)
class ReportRow:
    weights: str
    kv_type: str
    file_bytes: int
    perplexity: float
    perplexity_error: float
    perplexity_change_pct: float | None  # against the F16 weights with an F16 KV cache
    tokens_scored: int
    prefill_tokens_per_s: float
    prefill_tokens_per_s_sd: float  # over the repetitions, as bench gives it
    decode_tokens_per_s: float
    decode_tokens_per_s_sd: float
    threads: int  # that the speeds were measured with
    kv_bytes: int  # at settings.kv_ctx

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(
    models: Sequence[tuple[str, Path]],
    tokens_for: Callable[[Engine], list[int]],
    settings: ReportSettings,
    on_window: Callable[[str, str, PerplexityProgress], None] = lambda *_a: None,
) -> Iterator[ReportRow]:
    """One row per (weights, KV type), in order; models[0] is the F16 baseline."""
    baseline: float | None = None
    for weights, path in models:
        shape = header_on_disk(path).shape
        for kv in settings.kv_types:
            # what the scoring load and the speed load share
            both = LoadOptions(threads=settings.threads, kv_type_k=kv, kv_type_v=kv)
            window = settings.window
            scoring = dataclasses.replace(both, n_ctx=window, n_batch=min(window, 2048))
            with open_engine(path, scoring, ModelSettings()) as engine:
                last = None
                for last in perplexity(engine, tokens_for(engine), window, settings.max_windows):
                    on_window(weights, kv, last)
            assert last is not None
            if baseline is None:
                baseline = last.perplexity
            speed = dataclasses.replace(
                both, n_ctx=settings.prompt_tokens + settings.gen_tokens + 2
            )
            rng = random.Random(0)
            with open_engine(path, speed, ModelSettings()) as engine:
                pp = measure_prompt(engine, [], settings.prompt_tokens, settings.repetitions, rng)
                tg = measure_generation(engine, [], settings.gen_tokens, settings.repetitions, rng)
                threads = engine.threads
            yield ReportRow(
                weights=weights,
                kv_type=kv,
                file_bytes=path.stat().st_size,
                perplexity=last.perplexity,
                perplexity_error=last.error,
                perplexity_change_pct=100 * (last.perplexity / baseline - 1),
                tokens_scored=last.tokens_scored,
                prefill_tokens_per_s=pp.tokens_per_s,
                prefill_tokens_per_s_sd=pp.tokens_per_s_sd,
                decode_tokens_per_s=tg.tokens_per_s,
                decode_tokens_per_s_sd=tg.tokens_per_s_sd,
                threads=threads,
                kv_bytes=plan(shape, settings.kv_ctx, kv, kv).kv_bytes,
            )

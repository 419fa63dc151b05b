"""quill bench: prefill and decode speed over a grid, as llama.cpp's llama-bench measures them.

For every combination of KV-cache type, threads and batch size a model is loaded; for every KV
depth D, prompt length P and generation length N it measures, after one warm-up round:
  ppP @ dD: P random tokens prefilled after D tokens already in the cache (tokens/s, and the time
            to the first token, which is what a user waits for with a P-token prompt)
  tgN @ dD: N tokens decoded one by one after D tokens in the cache (tokens/s, and the bytes each
            step must read: all weights plus the KV cache so far, hence the memory bandwidth that
            speed implies)
Like every other consumer, it only drives Engine.stream_generate: the depth is filled once and the
engine's prefix cache keeps it, so only the measured tokens are computed in the timed call.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from cli.engine.engine import Engine, LoadOptions
from cli.engine.events import StreamEvent
from cli.engine.sampling import SamplingParams
from cli.errors import UsageError
from quant.kv import check_kv_type

GREEDY_NO_EOS = SamplingParams(temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class BenchGrid:
    prompt_tokens: tuple[int, ...] = (512,)
    gen_tokens: tuple[int, ...] = (128,)
    depths: tuple[int, ...] = (0,)
    kv_types: tuple[str, ...] = ("f16",)
    threads: tuple[int, ...] = ()  # empty: physical cores
    batches: tuple[int, ...] = (512,)
    repacks: tuple[bool, ...] = (True,)  # weight repacking on and/or off (cli/engine/loading.py)
    repetitions: int = 5
    spec: tuple[str, ...] = ("off",)  # speculative decoding modes for tg rows (tgN+ngram, ...)

    def check(self, trained_ctx: int | None = None) -> None:
        """Refuse a grid that cannot run, before anything is loaded."""
        for name, values in (
            ("-p/--prompt-tokens", self.prompt_tokens),
            ("-n/--gen-tokens", self.gen_tokens),
            ("--threads", self.threads),
            ("--batch", self.batches),
        ):
            if any(v <= 0 for v in values):
                raise UsageError(f"{name} takes positive numbers, not {list(values)}")
        if any(d < 0 for d in self.depths):
            raise UsageError(f"--depth takes numbers of tokens >= 0, not {list(self.depths)}")
        if not (self.prompt_tokens or self.gen_tokens):
            raise UsageError("nothing to measure: give -p or -n a length")
        if self.repetitions < 1:
            raise UsageError(f"-r/--repetitions must be at least 1, not {self.repetitions}")
        for kv in self.kv_types:
            try:
                check_kv_type(kv, "--kv-type")
            except ValueError as error:
                raise UsageError(str(error)) from None
        if trained_ctx is not None and self.needed_ctx > trained_ctx:
            raise UsageError(
                f"depth {max(self.depths)} + {self.needed_ctx - max(self.depths)} more tokens need "
                f"{self.needed_ctx} positions, but the model was trained for {trained_ctx}: "
                "lower --depth, -p or -n"
            )

    @property
    def needed_ctx(self) -> int:
        longest = max([*self.prompt_tokens, *(n + 1 for n in self.gen_tokens)])
        return max(self.depths) + longest + 1


@dataclass(frozen=True)
class BenchRow:
    test: str  # "pp512" or "tg128"
    depth: int
    kv_type: str
    threads: int | None  # None: a remote server's, unknown here
    batch: int | None
    tokens_per_s: float
    tokens_per_s_sd: float
    ttft_ms: float | None = None  # pp rows: time to the first token for a prompt of P tokens
    ttft_ms_sd: float | None = None
    bytes_per_token: int | None = None  # tg rows: weights + KV read per decode step
    bandwidth_gb_s: float | None = None  # tg rows: bytes_per_token x tokens/s
    samples: list[float] = field(default_factory=list)
    cpu_path: str = ""  # how the weights sat on the CPU: extra, amx-repack, amx-plain or plain
    acceptance_rate: float | None = None  # tgN+MODE rows: drafted tokens the model agreed with
    cached_tokens: int | None = None  # remote ppP rows: the most prompt tokens the server reused

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def run_bench(
    model: Path,
    grid: BenchGrid,
    on_load: Callable[[Engine], None] = lambda _e: None,
    speculate: Callable[[Engine, str], None] = lambda _e, _mode: None,
) -> Iterator[BenchRow]:
    """Yield one row per combination, in grid order; speculate(engine, mode) sets the
    speculative decoding of the tg rows of each mode in grid.spec."""
    rng = random.Random(0)
    for repack, kv_type, threads, batch in itertools.product(
        grid.repacks, grid.kv_types, grid.threads or (None,), grid.batches
    ):
        options = LoadOptions(
            n_ctx=grid.needed_ctx,
            n_batch=batch,
            threads=threads,
            kv_type_k=kv_type,
            kv_type_v=kv_type,
            repack=repack,
        )
        with Engine(model, options) as engine:
            on_load(engine)
            for depth in grid.depths:
                context = [rng.randrange(engine.n_vocab) for _ in range(depth)]
                for p in grid.prompt_tokens:
                    yield measure_prompt(engine, context, p, grid.repetitions, rng)
                for n in grid.gen_tokens:
                    for mode in grid.spec:
                        speculate(engine, mode)
                        row = measure_generation(engine, context, n, grid.repetitions, rng)
                        if mode != "off":
                            stats = engine.speculator.last_stats if engine.speculator else None
                            rate = stats.acceptance_rate if stats else None
                            row = replace(row, test=f"{row.test}+{mode}", acceptance_rate=rate)
                        yield row
                speculate(engine, "off")


def _fill(engine: Engine, context: list[int]) -> None:
    if context:
        for _ in engine.stream_generate(context, 1, GREEDY_NO_EOS):
            pass


def measure_prompt(
    engine: Engine,
    context: list[int],
    p: int,
    reps: int,
    rng: random.Random,
    warmup: bool = True,
) -> BenchRow:
    """ppP at depth len(context): prefill speed and time to the first token."""
    rates: list[float] = []
    ttfts: list[float] = []
    for rep in range(reps + warmup):  # a warm-up round is dropped
        _fill(engine, context)
        prompt = context + [rng.randrange(engine.n_vocab) for _ in range(p)]
        started = time.perf_counter()
        first = next(iter(engine.stream_generate(prompt, 1, GREEDY_NO_EOS)))
        waited = time.perf_counter() - started
        assert first.cached_prompt_tokens >= len(context) - 1
        if rep or not warmup:
            rates.append(first.prefill_tokens_per_s)
            ttfts.append(waited * 1000)
    rate, rate_sd = mean_sd(rates)
    ttft, ttft_sd = mean_sd(ttfts)
    return BenchRow(
        f"pp{p}",
        len(context),
        engine.kv_type_k,
        engine.threads,
        engine.n_batch,
        rate,
        rate_sd,
        ttft,
        ttft_sd,
        samples=rates,
        cpu_path=engine.cpu_path.label,
    )


def measure_generation(
    engine: Engine,
    context: list[int],
    n: int,
    reps: int,
    rng: random.Random,
    warmup: bool = True,
) -> BenchRow:
    """tgN at depth len(context): decode speed, bytes read per token, implied bandwidth."""
    rates: list[float] = []
    for rep in range(reps + warmup):
        _fill(engine, context)
        prompt = [*context, rng.randrange(engine.n_vocab)]
        last = list(engine.stream_generate(prompt, n + 1, GREEDY_NO_EOS))[-1]
        assert last.generation_tokens == n + 1
        if rep or not warmup:
            rates.append(last.decode_tokens_per_s)
    rate, rate_sd = mean_sd(rates)
    # Each decode step reads every weight once and the KV cache of every position before it.
    average_depth = len(context) + 1 + n / 2
    bytes_per_token = int(engine.weights_bytes + average_depth * engine.kv_bytes_per_position)
    return BenchRow(
        f"tg{n}",
        len(context),
        engine.kv_type_k,
        engine.threads,
        engine.n_batch,
        rate,
        rate_sd,
        bytes_per_token=bytes_per_token,
        bandwidth_gb_s=bytes_per_token * rate / 1e9,
        samples=rates,
        cpu_path=engine.cpu_path.label,
    )


ONE_TOKEN_WORDS = (" the", " of", " and", " to", " in", " is", " was", " for")


def endpoint_prompt(p: int, rep: int) -> str:
    """About P one-token words, different for each repetition from its first word on, so that
    no server can answer a repetition from the prefix cache of an earlier one."""
    rng = random.Random(rep)
    return "".join(rng.choice(ONE_TOKEN_WORDS) for _ in range(p))


def run_endpoint_bench(
    url: str, model: str, grid: BenchGrid, api_key: str | None = None
) -> Iterator[BenchRow]:
    """ppP and tgN against an OpenAI-compatible server, timed from SSE arrivals here.

    Each repetition sends a distinct prompt of about P tokens with cache_prompt false (the server's
    usage count is what the rate is computed from, and its cached count is kept in the row);
    ppP's rate is prompt tokens over the time to the first token, which includes the network
    and any queueing, as a client sees it. Threads and batch are the server's, unknown here.
    """
    from cli.api.client import stream_chat

    def last_event(prompt: str, max_tokens: int) -> StreamEvent:
        return list(
            stream_chat(
                url, [("user", prompt)], model, max_tokens, GREEDY_NO_EOS,
                api_key=api_key, cache_prompt=False,
            )
        )[-1]  # fmt: skip

    for p in grid.prompt_tokens:
        rates, ttfts, cached = [], [], 0
        for rep in range(grid.repetitions + 1):
            last = last_event(endpoint_prompt(p, rep), 1)
            if rep:  # the first round warms the server up
                ttfts.append(last.prefill_s * 1000)
                rates.append(last.prompt_tokens / last.prefill_s if last.prefill_s else 0.0)
                cached = max(cached, last.cached_prompt_tokens)
        rate, rate_sd = mean_sd(rates)
        ttft, ttft_sd = mean_sd(ttfts)
        yield BenchRow(
            f"pp{p}", 0, "remote", None, None, rate, rate_sd, ttft, ttft_sd,
            samples=rates, cached_tokens=cached,
        )  # fmt: skip
    for n in grid.gen_tokens:
        rates = []
        for rep in range(grid.repetitions + 1):
            last = last_event("Hi", n + 1)
            if rep:
                rates.append(last.decode_tokens_per_s)
        rate, rate_sd = mean_sd(rates)
        yield BenchRow(f"tg{n}", 0, "remote", None, None, rate, rate_sd, samples=rates)

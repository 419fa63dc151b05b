"""quill bench: prefill and decode speed over a grid, as llama.cpp's llama-bench measures them.

For every combination of KV-cache type, threads and batch size a model is loaded; for every KV
depth D, prompt length P and generation length N, after one warm-up round:
  ppP @ dD: P random tokens prefilled after D cached tokens (tokens/s; time to the first token)
  tgN @ dD: N tokens decoded one by one after D cached tokens (tokens/s; the bytes each step
            reads, weights plus the KV cache so far, hence the GB/s that speed implies and its
            share of this machine's measured read bandwidth: cli/measure/bandwidth.py; with
            grid.predict, the speed cli/measure/predict.py predicts from the header alone)
It only drives Engine.stream_generate: the engine's prefix cache keeps the depth filled once, so
the timed call computes only the measured tokens.
"""

from __future__ import annotations

import functools
import itertools
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from cli.engine.engine import Engine
from cli.engine.events import StreamEvent
from cli.engine.freecores import measure_free_cores
from cli.engine.opening import open_engine
from cli.engine.options import ALL_LAYERS, LoadOptions
from cli.engine.sampling import SamplingParams
from cli.engine.settings import ModelSettings
from cli.measure.bandwidth import (
    Bandwidth,
    kv_read_per_token,
    read_bandwidth,
    weights_read_per_token,
)
from cli.measure.paths import Workload, placed
from cli.measure.predict import (
    VECTORS,
    DecodeCalibration,
    DecodePrediction,
    decode_calibration,
    predict_decode,
    weights_read_by_type,
)
from cli.store.header import header_on_disk
from quant.gguf import GGUFHeader
from quant.memory import ModelShape

GREEDY_NO_EOS = SamplingParams(temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class BenchGrid:
    prompt_tokens: tuple[int, ...] = (512,)
    gen_tokens: tuple[int, ...] = (128,)
    depths: tuple[int, ...] = (0,)
    kv_types: tuple[str, ...] = ("f16",)
    threads: tuple[int, ...] = ()  # empty: the cores other work leaves free, at each load
    batches: tuple[int, ...] = (512,)
    # Weight repacking: auto (the path table's placement for each row's work), on, off.
    repacks: tuple[str, ...] = ("auto",)
    repetitions: int = 5
    spec: tuple[str, ...] = ("off",)  # speculative decoding modes for tg rows (tgN+ngram, ...)
    rpc: tuple[str, ...] = ()  # RPC servers that hold every layer (cli/engine/rpc.py)
    predict: bool = False  # tg rows: also the decode speed predicted from the header alone

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
    weights_kv_gb_per_s: float | None = None  # tg rows: bytes_per_token x tokens/s
    bandwidth_share: float | None = None  # tg rows: that / read_bandwidth's GB/s
    read_bandwidth: Bandwidth | None = None  # tg rows: the machine's, with the row's threads
    samples: list[float] = field(default_factory=list)
    cpu_path: str = ""  # how the weights sat on the CPU: extra, amx-repack, amx-plain or plain
    acceptance_rate: float | None = None  # tgN+MODE rows: drafted tokens the model agreed with
    cached_tokens: int | None = None  # remote ppP rows: the most prompt tokens the server reused
    replica_of: str | None = None  # the model a replica's rows measure (its weights are noise)
    rpc: tuple[str, ...] = ()  # the RPC servers that held the layers
    predicted_tokens_per_s: float | None = None  # tg rows with grid.predict: from the header
    measured_over_predicted: float | None = None  # tokens_per_s / predicted_tokens_per_s
    prediction: DecodePrediction | None = None  # how it was predicted
    calibration: DecodeCalibration | None = None  # the terms it took (the row's threads)


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def run_bench(
    model: Path,
    grid: BenchGrid,
    on_load: Callable[[Engine], None] = lambda _e: None,
    speculate: Callable[[Engine, str], None] = lambda _e, _mode: None,
    on_note: Callable[[str], None] = lambda _m: None,
) -> Iterator[BenchRow]:
    """Yield one row per combination, in grid order; speculate(engine, mode) sets the
    speculative decoding of the tg rows of each mode in grid.spec; on_note is told of a
    measurement of the path table (before any timed one)."""
    rng = random.Random(0)
    header = header_on_disk(model).header
    weights, shape = weights_read_per_token(header), ModelShape.from_header(header)
    facts: dict[int, _TgFacts] = {}  # by threads
    for repack, kv_type, threads, batch in itertools.product(
        grid.repacks, grid.kv_types, grid.threads or (None,), grid.batches
    ):
        # Measured once and then fixed, as llama-bench's -t is: a row keeps its thread count.
        threads = threads or measure_free_cores().threads
        if threads not in facts:  # before the load, quiet; cached after once
            # the weights are read on the RPC servers' machines: no bandwidth or prediction here
            limit = read_bandwidth(threads) if not grid.rpc else None
            calibration = None
            if grid.predict and not grid.rpc:
                types = [kind for kind in weights_read_by_type(header) if kind != VECTORS]
                calibration = decode_calibration(threads, types, grid.kv_types)
            facts[threads] = _TgFacts(header, shape, weights, limit, calibration, grid.rpc)
        options = LoadOptions(
            n_ctx=grid.needed_ctx,
            n_batch=batch,
            threads=threads,
            kv_type_k=kv_type,
            kv_type_v=kv_type,
            repack=repack != "off",
            gpu_layers=ALL_LAYERS if grid.rpc else 0,
            rpc=grid.rpc,
        )
        for placed_options, prompts, gens in _loads(model, options, repack, grid, on_note):
            with open_engine(model, placed_options, ModelSettings()) as engine:
                on_load(engine)
                for depth in grid.depths:
                    context = [rng.randrange(engine.n_vocab) for _ in range(depth)]
                    for p in prompts:
                        row = measure_prompt(engine, context, p, grid.repetitions, rng)
                        yield replace(row, rpc=grid.rpc)
                    for n in gens:
                        for mode in grid.spec:
                            speculate(engine, mode)
                            row = measure_generation(engine, context, n, grid.repetitions, rng)
                            yield _described_tg(row, engine, mode, depth, n, facts[threads])
                    speculate(engine, "off")


@dataclass(frozen=True)
class _TgFacts:
    """What a tg row's traffic and prediction are worked out from."""

    header: GGUFHeader
    shape: ModelShape
    weights: int  # bytes a step reads of the weights
    limit: Bandwidth | None
    calibration: DecodeCalibration | None
    rpc: tuple[str, ...]


def _described_tg(
    row: BenchRow, engine: Engine, mode: str, depth: int, n: int, facts: _TgFacts
) -> BenchRow:
    """A tg row with its traffic, prediction and speculation."""
    # A step reads the weights and the KV cache of every position before it.
    mean_depth = depth + 1 + n / 2
    kv = kv_read_per_token(facts.shape, mean_depth, engine.kv_type_k)
    if facts.limit is not None:  # none where the weights are read on RPC servers' machines
        row = with_traffic(row, facts.weights + kv, facts.limit)
    if mode == "off" and facts.calibration is not None:
        row = with_prediction(row, facts.header, mean_depth, facts.calibration)
    row = replace(row, rpc=facts.rpc)
    if mode != "off":
        stats = engine.speculator.last_stats if engine.speculator else None
        rate = stats.acceptance_rate if stats else None
        row = replace(row, test=f"{row.test}+{mode}", acceptance_rate=rate)
    return row


def _loads(
    model: Path, options: LoadOptions, repack: str, grid: BenchGrid, on_note: Callable[[str], None]
) -> list[tuple[LoadOptions, list[int], list[int]]]:
    """(options, ppP rows, tgN rows): a load for each placement the rows need. With repack auto,
    a ppP row is placed for P prompt tokens and a tgN row for N generated ones, as `quill run`
    would place them for that work (cli/measure/paths.py)."""
    loads: dict[LoadOptions, tuple[list[int], list[int]]] = {}
    for p in grid.prompt_tokens:
        work = Workload(f"pp{p}", p, 0)
        loads.setdefault(placed(model, options, repack, work, on_note), ([], []))[0].append(p)
    for n in grid.gen_tokens:
        work = Workload(f"tg{n}", 1, n)
        loads.setdefault(placed(model, options, repack, work, on_note), ([], []))[1].append(n)
    return [(placed_options, prompts, gens) for placed_options, (prompts, gens) in loads.items()]


T = TypeVar("T")


def _rounds(reps: int, measure: Callable[[int], T]) -> list[T]:
    """measure(round) for a warm-up round, which is dropped, and reps measured ones."""
    return [measure(round_) for round_ in range(reps + 1)][1:]


Where = tuple[int, str, int | None, int | None]  # a row's depth, KV type, threads and batch


def _row(
    test: str, where: Where, rates: list[float], ttfts: Sequence[float] = (), **facts: Any
) -> BenchRow:
    """A test's row from the rates (and times to the first token) of its rounds."""
    depth, kv_type, threads, batch = where
    rate, rate_sd = mean_sd(rates)
    ttft, ttft_sd = mean_sd(ttfts) if ttfts else (None, None)
    return BenchRow(
        test, depth, kv_type, threads, batch, rate, rate_sd, ttft, ttft_sd, samples=rates, **facts
    )


def _where(engine: Engine, context: list[int]) -> Where:
    return len(context), engine.kv_type_k, engine.threads, engine.n_batch


def _fill(engine: Engine, context: list[int]) -> None:
    if context:
        for _ in engine.stream_generate(context, 1, GREEDY_NO_EOS):
            pass


def measure_prompt(
    engine: Engine, context: list[int], p: int, reps: int, rng: random.Random
) -> BenchRow:
    """ppP at depth len(context): prefill speed and time to the first token."""

    def prefill(_round: int) -> tuple[float, float]:
        _fill(engine, context)
        prompt = context + [rng.randrange(engine.n_vocab) for _ in range(p)]
        started = time.perf_counter()
        first = next(iter(engine.stream_generate(prompt, 1, GREEDY_NO_EOS)))
        waited = time.perf_counter() - started
        assert first.cached_prompt_tokens >= len(context) - 1
        return first.prefill_tokens_per_s, waited * 1000

    rates, ttfts = zip(*_rounds(reps, prefill), strict=True)
    path = engine.cpu_path.label
    return _row(f"pp{p}", _where(engine, context), list(rates), ttfts, cpu_path=path)


def measure_generation(
    engine: Engine, context: list[int], n: int, reps: int, rng: random.Random
) -> BenchRow:
    """tgN at depth len(context): decode speed."""

    def decode(_round: int) -> float:
        _fill(engine, context)
        prompt = [*context, rng.randrange(engine.n_vocab)]
        last = list(engine.stream_generate(prompt, n + 1, GREEDY_NO_EOS))[-1]
        assert last.generation_tokens == n + 1
        return last.decode_tokens_per_s

    rates = _rounds(reps, decode)
    return _row(f"tg{n}", _where(engine, context), rates, cpu_path=engine.cpu_path.label)


def with_traffic(row: BenchRow, per_token: int, limit: Bandwidth) -> BenchRow:
    """The row with the bytes a step reads, the GB/s its speed implies and their share of limit."""
    gb_per_s = per_token * row.tokens_per_s / 1e9
    share = gb_per_s / limit.gb_per_s
    return replace(
        row,
        bytes_per_token=per_token,
        weights_kv_gb_per_s=gb_per_s,
        bandwidth_share=share,
        read_bandwidth=limit,
    )


def with_prediction(
    row: BenchRow, header: GGUFHeader, depth: float, calibration: DecodeCalibration
) -> BenchRow:
    """The tg row with the speed predicted for it from the header and its ratio to the measured."""
    assert row.threads is not None  # a row measured here
    predicted = predict_decode(header, row.threads, depth, row.kv_type, calibration)
    return replace(
        row,
        predicted_tokens_per_s=predicted.tokens_per_s,
        measured_over_predicted=row.tokens_per_s / predicted.tokens_per_s,
        prediction=predicted,
        calibration=calibration,
    )


ONE_TOKEN_WORDS = (" the", " of", " and", " to", " in", " is", " was", " for")
REMOTE: Where = (0, "remote", None, None)  # threads and batch are the server's, unknown here


def endpoint_prompt(p: int, rep: int) -> str:
    """About P one-token words, different for each repetition from its first word on, so that
    no server can answer a repetition from the prefix cache of an earlier one."""
    rng = random.Random(rep)
    return "".join(rng.choice(ONE_TOKEN_WORDS) for _ in range(p))


def run_endpoint_bench(
    url: str, model: str, grid: BenchGrid, api_key: str | None = None
) -> Iterator[BenchRow]:
    """ppP and tgN against an OpenAI-compatible server, timed from SSE arrivals here. Each
    repetition sends a distinct prompt of about P tokens with cache_prompt false; ppP's rate is
    the server's count of prompt tokens over the time to the first token, network and queueing
    included, as a client sees it; the row keeps the most tokens the server still had cached."""
    from cli.api.client import stream_chat

    def last_event(prompt: str, max_tokens: int) -> StreamEvent:
        return list(
            stream_chat(
                url, [("user", prompt)], model, max_tokens, GREEDY_NO_EOS,
                api_key=api_key, cache_prompt=False,
            )
        )[-1]  # fmt: skip

    def first_of_prompt(p: int, rep: int) -> StreamEvent:
        return last_event(endpoint_prompt(p, rep), 1)

    def last_of_reply(n: int, _rep: int) -> StreamEvent:
        return last_event("Hi", n + 1)

    for p in grid.prompt_tokens:
        firsts = _rounds(grid.repetitions, functools.partial(first_of_prompt, p))
        rates = [e.prompt_tokens / e.prefill_s if e.prefill_s else 0.0 for e in firsts]
        ttfts = [e.prefill_s * 1000 for e in firsts]
        cached = max(e.cached_prompt_tokens for e in firsts)
        yield _row(f"pp{p}", REMOTE, rates, ttfts, cached_tokens=cached)
    for n in grid.gen_tokens:
        lasts = _rounds(grid.repetitions, functools.partial(last_of_reply, n))
        yield _row(f"tg{n}", REMOTE, [e.decode_tokens_per_s for e in lasts])

"""quill perplexity and quill quant-report: the commands that measure what quantization costs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cli.commands import options as shared
from cli.errors import Interrupted, UsageError

if TYPE_CHECKING:
    from cli.engine.options import LoadOptions
    from cli.measure.perplexity import PerplexityProgress
    from cli.measure.quantreport import ReportRow, ReportSettings
    from cli.store.models import ModelRequest

PPL_EPILOG = (
    "Scores the text the way llama.cpp's llama-perplexity does: windows of --ctx tokens, each "
    "from an empty cache, the second half of each scored."
)


# A text to score, not a corpus: wikitext-2's test set is 1.3 MB.
MAX_TEXT_BYTES = 256 << 20


def read_text(path: Path) -> str:
    from cli.userfiles import read_user_text

    return read_user_text(path, "text", MAX_TEXT_BYTES, "score a part of it")


def _check_window(window: int, trained_ctx: int) -> None:
    if window < 16:
        raise UsageError(f"--ctx {window} is too small to score; use 128 or more (default 512)")
    if window > trained_ctx:
        raise UsageError(
            f"--ctx {window} is beyond the {trained_ctx} positions the model was trained for; "
            f"use {trained_ctx} or less"
        )


def perplexity(
    name: shared.ModelArgument = None,
    model: shared.ModelOption = None,
    file: Annotated[
        Path, typer.Option("-f", "--file", help="The text to score (UTF-8).", show_default=False)
    ] = ...,  # type: ignore[assignment]
    ctx: Annotated[int, typer.Option("-c", "--ctx", help="Tokens per window.")] = 512,
    chunks: Annotated[
        int | None,
        typer.Option("--chunks", min=1, help="Score only the first N windows (default: all)."),
    ] = None,
    kv_type: shared.KvType = "f16",
    kv_k: shared.KvK = None,
    kv_v: shared.KvV = None,
    threads: shared.Threads = None,
    gpu_layers: shared.GpuLayers = None,
    json_output: shared.JsonOutput = False,
    offline: shared.Offline = False,
    verbose: shared.Verbose = False,
) -> None:
    """Perplexity of a model over a text file, with its ± error: lower is better, and the change
    against the F16 model is what a quantization costs."""
    from cli.store.models import read_model
    from cli.ui import render

    options = dataclasses.replace(
        shared.load_options(ctx, threads, gpu_layers, kv_type, kv_k, kv_v), n_batch=min(ctx, 2048)
    )
    type_k, type_v = options.kv_type_k, options.kv_type_v
    text = read_text(file)
    label, path = shared.obtain_model(shared.model_name(name, model), offline)
    _check_window(ctx, read_model(path).context_length or ctx)
    last, tokens, threads_used = _score(path, options, text, file.name, ctx, chunks, verbose)
    if json_output:
        result = {
            "model": label,
            "path": str(path),
            "file": str(file),
            "tokens": tokens,
            "window": ctx,
            "windows": last.windows,
            "tokens_scored": last.tokens_scored,
            "perplexity": last.perplexity,
            "perplexity_error": last.error,
            "seconds": last.seconds,
            "tokens_per_s": last.tokens_per_s,
            "kv_type_k": type_k,
            "kv_type_v": type_v,
            "threads": threads_used,
        }
        render.write_stdout(json.dumps(result, indent=1) + "\n")
    else:
        render.write_stdout(
            f"perplexity {last.perplexity:.4f} ± {last.error:.4f} "
            f"({last.tokens_scored} tokens scored in {last.windows} windows of {ctx})\n"
        )
    render.info_line(
        f"{last.seconds:.1f} s, {last.tokens_per_s:.0f} tokens/s evaluated, "
        f"{threads_used} threads, KV {type_k}/{type_v}"
    )


def _score(
    path: Path,
    options: LoadOptions,
    text: str,
    file_name: str,
    window: int,
    chunks: int | None,
    verbose: bool,
) -> tuple[PerplexityProgress, int, int]:
    """(the last running estimate, the text's tokens, the threads used): the model at path
    scores the text, window by window, with a progress bar."""
    from cli.engine.engine import NO_SETTINGS
    from cli.engine.opening import open_engine
    from cli.measure.perplexity import perplexity as score
    from cli.measure.perplexity import windows_in
    from cli.ui import render
    from cli.ui.progress import StepProgress

    last = None
    try:
        with open_engine(path, options, NO_SETTINGS, verbose) as engine:
            tokens = engine.tokenize(text)
            available = windows_in(len(tokens), window)
            scored = f", scoring the first {chunks}" if chunks and chunks < available else ""
            render.info_line(
                f"{file_name}: {len(tokens)} tokens, {available} windows of {window}{scored}"
            )
            with StepProgress("windows") as progress:
                for last in score(engine, tokens, window, chunks):
                    progress.update(
                        last.windows_done,
                        last.windows,
                        f"PPL {last.perplexity:.4f} ± {last.error:.4f}",
                    )
            threads_used = engine.threads
    except KeyboardInterrupt:
        so_far = (
            ""
            if last is None
            else (f" after {last.windows_done} windows: PPL so far {last.perplexity:.4f}")
        )
        raise Interrupted(f"interrupted{so_far}") from None
    assert last is not None
    return last, len(tokens), threads_used


def quant_report(
    name: shared.ModelArgument = None,
    model: shared.ModelOption = None,
    file: Annotated[
        Path, typer.Option("-f", "--file", help="The text to score (UTF-8).", show_default=False)
    ] = ...,  # type: ignore[assignment]
    types: Annotated[
        str, typer.Option("--types", help="Weight types, the first being the baseline.")
    ] = "f16,q8_0,q4_k_m,q4_0",
    kv_types_option: Annotated[
        str, typer.Option("--kv-types", help="KV-cache types, e.g. f16,q8_0,q4_0.")
    ] = "f16,q8_0,q4_0",
    ctx: Annotated[int, typer.Option("-c", "--ctx", help="Tokens per perplexity window.")] = 512,
    chunks: Annotated[
        int, typer.Option("--chunks", min=1, help="Perplexity windows scored per row.")
    ] = 8,
    prompt_tokens: Annotated[
        int, typer.Option("-p", "--prompt-tokens", min=1, help="Prompt length for prefill speed.")
    ] = 512,
    gen_tokens: Annotated[
        int, typer.Option("-n", "--gen-tokens", min=2, help="Tokens decoded for decode speed.")
    ] = 64,
    repetitions: Annotated[
        int, typer.Option("-r", "--repetitions", min=1, help="Speed rounds after a warm-up.")
    ] = 2,
    kv_ctx: Annotated[
        int, typer.Option("--kv-ctx", min=1, help="Context the KV bytes are given for.")
    ] = 4096,
    threads: shared.Threads = None,
    json_output: shared.JsonOutput = False,
    markdown_output: shared.MarkdownOutput = False,
    offline: shared.Offline = False,
) -> None:
    """Which quant should I use on this machine? Quantizes the model to each weight type, then
    measures size, perplexity and its change against F16, prefill and decode speed and KV bytes
    for each KV-cache type."""
    from cli.measure.quantreport import ReportSettings
    from cli.store.making import target_type
    from cli.store.models import read_model
    from cli.ui import render

    chosen = shared.model_name(name, model)
    shared.check_threads(threads)
    weights = [target_type(t) for t in types.split(",")]
    kvs = kv_types_option.split(",")
    for kv in kvs:
        shared.kv_types(kv, None, None)
    output = shared.output_format(json_output, markdown_output=markdown_output)
    text = read_text(file)
    request = shared.model_request(chosen)
    label, source = request.label, shared.obtain_request(request, offline)
    _check_window(ctx, read_model(source).context_length or ctx)
    models = _quantized_models(request, source, weights, threads)
    settings = ReportSettings(
        weight_types=tuple(weights),
        kv_types=tuple(kvs),
        window=ctx,
        max_windows=chunks,
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        repetitions=repetitions,
        kv_ctx=kv_ctx,
        threads=threads,
    )
    rows = _measured_rows(models, text, settings)
    if output.json:
        report = {
            "model": label,
            "file": str(file),
            "settings": settings.__dict__,
            "rows": [row.as_dict() for row in rows],
        }
        render.write_stdout(json.dumps(report, indent=1) + "\n")
    else:
        render.quant_report_table(rows, kv_ctx, markdown=output.markdown)


def report_files() -> Path:
    """Where quant-report keeps the files it quantizes: apart from the user's models, and made
    again by each report."""
    from cli.store.home import quill_home

    folder = quill_home() / "cache" / "quant-report"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _quantized_models(
    request: ModelRequest, source: Path, weights: list[str], threads: int | None
) -> list[tuple[str, Path]]:
    """(weight type, file) for each of weights, made with a progress bar: the first is the
    baseline, the source itself when it is of that type; the others are quantized from it."""
    from cli.engine.hardware import physical_cores
    from cli.store.making import make_quantized
    from cli.store.models import parse_model_name
    from cli.store.registry import load_registry
    from cli.ui import render
    from cli.ui.progress import StepProgress
    from quant.quantize import FLOAT_FILE_TYPES, source_file_type

    label = request.label
    registry = load_registry()
    quantize_threads = threads or physical_cores()
    file_type, _ = source_file_type(source)
    if file_type not in FLOAT_FILE_TYPES:
        render.warning_line(
            f"{label} is quantized: the {weights[0]} baseline is its dequantized copy, so the "
            "report measures re-quantization from those rounded weights"
        )
    with StepProgress("quantizing") as progress:

        def quantized(request: ModelRequest, source: Path, target: str) -> Path:
            # The report's own files, apart: a user's quantized model of the same name stays.
            output = report_files() / f"{source.stem}-{target}.gguf"
            made = make_quantized(
                label, request, source, target, registry, quantize_threads, output, force=True,
                on_tensor=progress.update, keep=False,
            )  # fmt: skip
            return Path(made.result.output)

        same = FLOAT_FILE_TYPES.get(file_type) == weights[0]
        baseline = source if same else quantized(request, source, weights[0])
        from_baseline = parse_model_name(str(baseline), registry)
        models = [(weights[0], baseline)]
        models += [(target, quantized(from_baseline, baseline, target)) for target in weights[1:]]
    return models


def _measured_rows(
    models: list[tuple[str, Path]], text: str, settings: ReportSettings
) -> list[ReportRow]:
    """The report's rows, each said as it is measured."""
    from cli.measure.quantreport import measure
    from cli.ui import render

    cache: dict[str, list[int]] = {}

    def tokens_for(engine) -> list[int]:
        # Every weight type shares the vocabulary: tokenize the text once.
        if "tokens" not in cache:
            cache["tokens"] = engine.tokenize(text)
        return cache["tokens"]

    rows = []
    for row in measure(models, tokens_for, settings):
        rows.append(row)
        render.info_line(
            f"{row.weights} + KV {row.kv_type}: PPL {row.perplexity:.4f} "
            f"({row.perplexity_change_pct:+.2f}%), pp {row.prefill_tokens_per_s:.0f} ± "
            f"{row.prefill_tokens_per_s_sd:.0f}, tg {row.decode_tokens_per_s:.1f} ± "
            f"{row.decode_tokens_per_s_sd:.1f} tok/s, {row.threads} threads"
        )
    return rows

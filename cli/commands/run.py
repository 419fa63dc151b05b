"""quill run: get the model (or a server), stream the reply to stdout, report the numbers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

import typer

from cli.commands.options import (
    DEFAULT_SAMPLING,
    ApiKey,
    GpuLayers,
    KvType,
    MinP,
    ModelOption,
    RepeatPenalty,
    Seed,
    Temperature,
    Threads,
    TopK,
    TopP,
    load_options,
    obtain_model,
    read_prompt,
    sampling_params,
)
from cli.commands.speculation import (
    DraftModel,
    DraftTokens,
    SpecMode,
    attach_speculation,
    check_spec_flags,
)
from cli.engine.sampling import SamplingParams
from cli.errors import EXIT_INTERRUPTED, EXIT_OK

if TYPE_CHECKING:
    from cli.engine.backend import Backend
    from cli.engine.events import StreamEvent
    from cli.engine.metrics import MetricsRecorder
    from cli.engine.options import LoadOptions


@dataclass(frozen=True)
class RunRequest:
    prompt: str
    model: str | None = None
    system: str | None = None
    raw: bool = False
    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    offline: bool = False
    json_output: bool = False
    show_stats: bool = True
    timeline: bool = False
    verbose: bool = False
    endpoint: str | None = None  # an OpenAI-compatible server instead of a local model
    api_key: str | None = None
    spec: str = "off"  # speculative decoding: off, ngram or draft (cli/engine/speculative.py)
    draft: str | None = None
    draft_tokens: int | None = None


def run(
    prompt: Annotated[
        str | None, typer.Argument(help="The prompt. Text on stdin is appended after it.")
    ] = None,
    model: ModelOption = None,
    system: Annotated[str | None, typer.Option("-s", "--system", help="System prompt.")] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as it is, without the chat template.")
    ] = False,
    max_tokens: Annotated[
        int, typer.Option("-n", "--max-tokens", min=1, help="Most tokens to generate.")
    ] = 512,
    temperature: Temperature = DEFAULT_SAMPLING.temperature,
    top_k: TopK = DEFAULT_SAMPLING.top_k,
    top_p: TopP = DEFAULT_SAMPLING.top_p,
    min_p: MinP = DEFAULT_SAMPLING.min_p,
    repeat_penalty: RepeatPenalty = DEFAULT_SAMPLING.repeat_penalty,
    seed: Seed = None,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos", help="Never end at the model's end-of-text token (benchmarks)."
        ),
    ] = False,
    stop: Annotated[
        list[str] | None,
        typer.Option("--stop", help="Stop when this text appears (repeatable); it is not printed."),
    ] = None,
    ctx: Annotated[
        int | None,
        typer.Option(
            "-c",
            "--ctx",
            min=16,
            help="Context window in tokens. Default: 4096, or less if trained less.",
        ),
    ] = None,
    threads: Threads = None,
    gpu_layers: GpuLayers = None,
    kv_type: KvType = "f16",
    kv_k: Annotated[
        str | None, typer.Option("--kv-k", help="K cache type (overrides --kv-type).")
    ] = None,
    kv_v: Annotated[
        str | None,
        typer.Option(
            "--kv-v",
            help="V cache type (overrides --kv-type); quantized V turns on flash attention.",
        ),
    ] = None,
    offline: Annotated[
        bool, typer.Option("--offline", help="Use only models already on disk; no network.")
    ] = False,
    timeline: Annotated[
        bool,
        typer.Option(
            "--timeline", help="After the reply, each token's arrival time and a histogram of gaps."
        ),
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (text and metrics) on stdout.")
    ] = False,
    no_stats: Annotated[
        bool, typer.Option("--no-stats", help="Do not print the stats line.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show llama.cpp's own log lines.")
    ] = False,
    endpoint: Annotated[
        str | None,
        typer.Option(
            "--endpoint",
            help="An OpenAI-compatible server (e.g. http://127.0.0.1:8080/v1) instead of a "
            "local model; -m names its model.",
        ),
    ] = None,
    api_key: ApiKey = None,
    spec: SpecMode = "off",
    draft: DraftModel = None,
    draft_tokens: DraftTokens = None,
) -> None:
    """Generate a reply to PROMPT, streamed to stdout; timing goes to stderr."""
    check_spec_flags(spec, draft, draft_tokens, endpoint)
    request = RunRequest(
        prompt=read_prompt(prompt),
        model=model,
        system=system,
        raw=raw,
        max_tokens=max_tokens,
        sampling=sampling_params(
            temperature, top_k, top_p, min_p, repeat_penalty, seed, ignore_eos
        ),
        stop=tuple(stop or ()),
        offline=offline,
        json_output=json_output,
        show_stats=not no_stats,
        timeline=timeline,
        verbose=verbose,
        endpoint=endpoint,
        api_key=api_key,
        spec=spec,
        draft=draft,
        draft_tokens=draft_tokens,
    )
    options = None if endpoint else load_options(ctx, threads, gpu_layers, kv_type, kv_k, kv_v)
    raise typer.Exit(run_once(request, options))


def open_backend(request: RunRequest, options: LoadOptions | None) -> tuple[str, Backend]:
    """(the model's name, the backend that runs it): a server's model, or a local engine."""
    from cli.ui import render

    if request.endpoint:
        from cli.api.client import RemoteModel, first_model

        name = request.model or first_model(request.endpoint, request.api_key) or "default"
        return name, RemoteModel(request.endpoint, name, request.api_key)
    from cli.engine.engine import Engine

    assert options is not None
    _, path = obtain_model(request.model, request.offline, request.verbose)
    if request.verbose:
        from cli.engine.options import DEFAULT_CTX
        from quant.memory import ModelShape, plan

        shape = ModelShape.from_gguf(path)
        n_ctx = options.n_ctx or min(DEFAULT_CTX, shape.trained_ctx or DEFAULT_CTX)
        kv = (options.kv_type_k, options.kv_type_v)
        render.info_line(render.memory_line(plan(shape, n_ctx, *kv)))
    from cli.store.registry import load_registry

    engine = Engine(path, options, request.verbose)
    attach_speculation(
        engine, request.spec, request.draft, request.draft_tokens, request.offline, request.verbose
    )
    return request.model or load_registry().default, engine


def run_once(request: RunRequest, options: LoadOptions | None = None) -> int:
    from cli.engine.metrics import MetricsRecorder
    from cli.ui import render

    name, backend = open_backend(request, options)
    try:
        recorder = MetricsRecorder()  # the request starts here: TTFT includes templating
        messages = [("system", request.system)] if request.system else []
        messages.append(("user", request.prompt))
        if request.raw:
            events = backend.stream_text(
                request.prompt, request.max_tokens, request.sampling, request.stop
            )
        else:
            if not backend.has_chat_template:
                render.warning_line(
                    "the model has no chat template llama.cpp can apply; sending the prompt as "
                    "'user: ...' lines, which base models only continue (--raw sends it as it is)"
                )
            events = backend.stream_chat(
                messages, request.max_tokens, request.sampling, request.stop
            )
        try:
            return _stream(backend, recorder, events, request, name)
        except BrokenPipeError:
            # The reader went away (quill run ... | head): stop quietly, as cat and grep do.
            render.silence_stdout()
            return EXIT_OK
    finally:
        backend.close()


def _stream(
    backend: Backend,
    recorder: MetricsRecorder,
    events: Iterator[StreamEvent],
    request: RunRequest,
    model_name: str,
) -> int:
    from cli.ui import render

    pieces: list[str] = []
    finish_override = None
    try:
        for event in events:
            pieces.append(event.text)
            if not request.json_output:
                render.write_stdout(event.text)
            recorder.observe(event)
    except KeyboardInterrupt:
        finish_override = "interrupted"
    metrics = recorder.summary(backend, finish_override)
    text = "".join(pieces)
    if request.json_output:
        render.write_stdout(render.run_json(model_name, backend.location, text, metrics) + "\n")
    else:
        if text and not text.endswith("\n"):  # a reply is a line, on a terminal or in a file
            render.write_stdout("\n")
        if request.timeline:
            speculator = getattr(backend, "speculator", None)
            stats = speculator.last_stats if speculator is not None else None
            render.print_timeline(recorder.arrivals(), guessed=stats.guessed if stats else ())
        if request.show_stats:
            render.print_stats(metrics)
    if request.verbose and backend.perf_note():
        render.info_line(backend.perf_note())
    return EXIT_INTERRUPTED if finish_override else EXIT_OK

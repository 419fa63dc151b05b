"""What `quill run` does, step by step: get the model, load it, build the prompt, stream, report."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cli.engine.engine import ALL_LAYERS, DEFAULT_CTX, Engine, LoadOptions, StreamEvent
from cli.engine.metrics import MetricsRecorder
from cli.engine.sampling import SamplingParams
from cli.errors import EXIT_INTERRUPTED, EXIT_OK, ContextOverflowError
from cli.store.models import obtain, parse_model_name
from cli.store.registry import load_registry
from cli.ui import render
from cli.ui.progress import download_progress

GPU_BUILD_HINT = (
    'CMAKE_ARGS="-DGGML_CUDA=on" pip install --no-cache-dir --force-reinstall llama-cpp-python '
    "(or -DGGML_METAL=on, -DGGML_VULKAN=on)"
)


@dataclass(frozen=True)
class RunRequest:
    prompt: str
    model: str | None = None
    system: str | None = None
    raw: bool = False
    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    ctx: int | None = None
    threads: int | None = None
    gpu_layers: int | None = None  # None: all on a GPU build, else 0
    kv_types: tuple[str, str] = ("f16", "f16")  # K, V
    offline: bool = False
    json_output: bool = False
    show_stats: bool = True
    timeline: bool = False
    verbose: bool = False
    endpoint: str | None = None  # an OpenAI-compatible server instead of a local model
    api_key: str | None = None


def resolve_gpu_layers(requested: int | None) -> int:
    import llama_cpp

    supported = bool(llama_cpp.llama_supports_gpu_offload())
    if requested is None:
        return ALL_LAYERS if supported else 0
    if requested != 0 and not supported:
        render.warning_line(
            "this llama-cpp-python build cannot offload to a GPU, so quill runs on the CPU; "
            f"for a GPU build: {GPU_BUILD_HINT}"
        )
        return 0
    return requested


def run_once(request: RunRequest) -> int:
    if request.endpoint:
        return run_endpoint(request)
    registry = load_registry()
    model_request = parse_model_name(request.model or registry.default, registry)
    path = obtain(
        model_request,
        offline=request.offline,
        report=render.info_line,
        progress=download_progress(),
        terminal=sys.stderr.isatty(),
        verbose=request.verbose,
    )
    options = LoadOptions(
        n_ctx=request.ctx,
        threads=request.threads,
        gpu_layers=resolve_gpu_layers(request.gpu_layers),
        kv_type_k=request.kv_types[0],
        kv_type_v=request.kv_types[1],
    )
    if request.verbose:
        from quant.memory import ModelShape, plan

        shape = ModelShape.from_gguf(path)
        n_ctx = request.ctx or min(DEFAULT_CTX, shape.trained_ctx or DEFAULT_CTX)
        render.info_line(render.memory_line(plan(shape, n_ctx, *request.kv_types)))
    with Engine(path, options, verbose=request.verbose) as engine:
        recorder = MetricsRecorder()  # the request starts here: TTFT includes templating
        prompt_text = request.prompt
        if not request.raw:
            messages = [("system", request.system)] if request.system else []
            templated = engine.chat_prompt([*messages, ("user", request.prompt)])
            if templated is None:
                render.warning_line(
                    "the model has no chat template llama.cpp can apply; sending the prompt as "
                    "raw text (--raw says so explicitly)"
                )
            else:
                prompt_text = templated
        tokens = engine.tokenize(prompt_text)
        if len(tokens) + request.max_tokens > engine.n_ctx:
            raise ContextOverflowError(
                len(tokens), request.max_tokens, engine.n_ctx, engine.trained_ctx
            )
        try:
            events = engine.stream_generate(
                tokens, request.max_tokens, request.sampling, request.stop
            )
            return _stream(engine, recorder, events, request, model_request.name, path)
        except BrokenPipeError:
            # The reader went away (quill run ... | head): stop quietly, as cat and grep do.
            render.silence_stdout()
            return EXIT_OK


def _stream(
    engine: Engine,
    recorder: MetricsRecorder,
    events: Iterator[StreamEvent],
    request: RunRequest,
    model_name: str,
    path: Path | str,  # the model file, or the endpoint's URL
) -> int:
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
    metrics = recorder.summary(engine, finish_override)
    text = "".join(pieces)
    if request.json_output:
        render.write_stdout(render.run_json(model_name, str(path), text, metrics) + "\n")
    else:
        if text and not text.endswith("\n") and sys.stdout.isatty():
            render.write_stdout("\n")
        if request.timeline:
            render.print_timeline(recorder.arrivals())
        if request.show_stats:
            render.print_stats(metrics)
    if request.verbose and isinstance(engine, Engine):
        render.info_line(f"llama.cpp perf: {engine.perf()}; weight repacking {engine.repack}")
    return EXIT_INTERRUPTED if finish_override else EXIT_OK


def run_endpoint(request: RunRequest) -> int:
    """The same output and metrics, from a server's SSE stream instead of a local engine."""
    from cli.api.client import RemoteInfo, first_model, stream_chat

    endpoint = request.endpoint or ""
    model = request.model or first_model(endpoint, request.api_key) or "default"
    messages = [("system", request.system)] if request.system else []
    messages.append(("user", request.prompt))
    recorder = MetricsRecorder()
    events = stream_chat(
        endpoint,
        messages,
        model,
        request.max_tokens,
        request.sampling,
        request.stop,
        request.api_key,
    )
    try:
        return _stream(
            RemoteInfo(),  # type: ignore[arg-type]
            recorder,
            events,
            request,
            model,
            endpoint,
        )
    except BrokenPipeError:
        render.silence_stdout()
        return EXIT_OK

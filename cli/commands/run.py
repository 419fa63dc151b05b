"""quill run: get the model (or a server), stream the reply to stdout, report the numbers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli.commands import options as shared
from cli.commands.cache import DEFAULT_CACHE_MAX, CacheMax, NoCache
from cli.commands.speculation import DraftModel, DraftTokens, SpecMode, spec_options
from cli.commands.structured_options import (
    FormatOption,
    GrammarOption,
    SchemaMultiOption,
    SchemaOption,
    StrictOption,
    build_constraint,
    check_output,
    constrained_sampling,
    system_with_schema,
)
from cli.commands.templating import ChatTemplateFile, Think, ThinkBudget, read_template_option
from cli.engine.events import MAX_TOP_LOGPROBS
from cli.engine.sampling import SamplingParams
from cli.engine.settings import ModelSettings
from cli.errors import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EndpointError,
    MissingEndpointError,
    UsageError,
)

if TYPE_CHECKING:
    from cli.engine.backend import Backend
    from cli.engine.events import StreamEvent, TokenLogprobs
    from cli.engine.metrics import MetricsRecorder
    from cli.engine.structured import Constraint


@dataclass(frozen=True)
class RunRequest:
    """What run_once does with an opened backend."""

    prompt: str
    system: str | None  # with the schema told, unless raw
    raw: bool
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    json_output: bool
    show_stats: bool
    timeline: bool
    verbose: bool
    hide_thinking: bool
    constraint: Constraint | None  # --schema, --format json or --grammar
    logprobs: int | None  # alternatives per token in the JSON's logprobs; None: none


def run(
    words: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[MODEL] PROMPT",
            show_default=False,
            help="The prompt; text on stdin comes first, then this. Two arguments are a model "
            "(as -m takes it: an alias, a model on disk, a .gguf path) and the prompt, in "
            "Ollama's order.",
        ),
    ] = None,
    model: shared.ModelOption = None,
    system: shared.System = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as it is, without the chat template.")
    ] = False,
    max_tokens: shared.MaxTokens = 512,
    temperature: shared.Temperature = shared.DEFAULT_SAMPLING.temperature,
    top_k: shared.TopK = shared.DEFAULT_SAMPLING.top_k,
    top_p: shared.TopP = shared.DEFAULT_SAMPLING.top_p,
    min_p: shared.MinP = shared.DEFAULT_SAMPLING.min_p,
    repeat_penalty: shared.RepeatPenalty = shared.DEFAULT_SAMPLING.repeat_penalty,
    seed: shared.Seed = None,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos", help="Never end at the model's end-of-text token (benchmarks)."
        ),
    ] = False,
    stop: shared.Stop = None,
    ctx: shared.Ctx = None,
    threads: shared.Threads = None,
    gpu_layers: shared.GpuLayers = None,
    rpc: shared.Rpc = None,
    kv_type: shared.KvType = "f16",
    kv_k: shared.KvK = None,
    kv_v: shared.KvV = None,
    offline: shared.Offline = False,
    timeline: Annotated[
        bool,
        typer.Option(
            "--timeline", help="After the reply, each token's arrival time and a histogram of gaps."
        ),
    ] = False,
    json_output: shared.JsonOutput = False,
    no_stats: shared.NoStats = False,
    verbose: shared.Verbose = False,
    endpoint: shared.Endpoint = None,
    api_key: shared.ApiKey = None,
    no_cache: NoCache = False,
    cache_max: CacheMax = DEFAULT_CACHE_MAX,
    chat_template: ChatTemplateFile = None,
    think: Think = None,
    think_budget: ThinkBudget = None,
    hide_thinking: Annotated[
        bool,
        typer.Option(
            "--hide-thinking", help="Do not print the reasoning (it goes to stderr otherwise)."
        ),
    ] = False,
    schema: SchemaOption = None,
    schema_multi: SchemaMultiOption = False,
    json_format: FormatOption = None,
    grammar: GrammarOption = None,
    strict: StrictOption = False,
    spec: SpecMode = "off",
    draft: DraftModel = None,
    draft_tokens: DraftTokens = None,
    logprobs: Annotated[
        int | None,
        typer.Option(
            "--logprobs",
            min=0,
            max=MAX_TOP_LOGPROBS,
            metavar="N",
            help="With --json: a 'logprobs' list, each generated token's log-probability and "
            f"the N (0-{MAX_TOP_LOGPROBS}) most likely tokens at its step, shaped as OpenAI's "
            "chat logprobs.content. Without --json nothing more is printed.",
        ),
    ] = None,
) -> None:
    """Generate a reply to PROMPT, streamed to stdout; reasoning and timing go to stderr."""
    model, prompt = shared.model_and_prompt(words or [], model)
    constraint = build_constraint(schema, schema_multi, json_format, grammar, strict)
    speculation = spec_options(spec, draft, draft_tokens, endpoint, constraint)
    if logprobs is not None and speculation is not None:
        raise UsageError(
            f"--logprobs cannot go with --spec {spec}: logprobs are read from each token's own "
            "logits, which speculative decoding skips; drop one of them"
        )
    source = shared.model_source(endpoint, api_key, offline, rpc)
    if endpoint and (chat_template or think is not None or think_budget is not None):
        raise UsageError(
            "--chat-template, --think and --think-budget apply to a local model; a server "
            "renders its own template (quill serve takes --chat-template and --think)"
        )
    if logprobs is not None and not json_output:
        from cli.ui import render

        render.warning_line("--logprobs shows only in --json output; none are computed without it")
    from cli.store.promptcache import run_cache
    from cli.store.registry import load_registry

    template, shown = read_template_option(chat_template), logprobs if json_output else None
    cache = None if no_cache else run_cache(shared.size_option("--cache-max", cache_max))
    settings = ModelSettings(template, think, think_budget, speculation, shown, cache)
    sampling = shared.sampling_params(
        temperature, top_k, top_p, min_p, repeat_penalty, seed, ignore_eos
    )
    request = RunRequest(
        prompt=shared.read_prompt(prompt),
        system=system if raw else system_with_schema(system, constraint),
        raw=raw,
        max_tokens=max_tokens,
        sampling=constrained_sampling(sampling, constraint),
        stop=tuple(stop or ()),
        json_output=json_output,
        show_stats=not no_stats,
        timeline=timeline,
        verbose=verbose,
        hide_thinking=hide_thinking,
        constraint=constraint,
        logprobs=logprobs,
    )
    # Checked with a server too, as chat checks them: a typo is one line whichever runs the model.
    options = shared.load_options(ctx, threads, gpu_layers, kv_type, kv_k, kv_v, rpc)
    local = None if endpoint else options
    name, backend = shared.open_backend(model, source, local, settings, verbose)
    if not endpoint:  # named as the user named it (the default: its alias)
        name = model or load_registry().default
    raise typer.Exit(run_once(request, name, backend))


def run_once(request: RunRequest, name: str, backend: Backend) -> int:
    from cli.commands.cache import finish_prompt_cache
    from cli.engine.metrics import MetricsRecorder
    from cli.ui import render

    try:
        recorder = MetricsRecorder()  # the request starts here: TTFT includes templating
        if request.raw:
            try:
                events = backend.stream_text(
                    request.prompt, request.max_tokens, request.sampling, request.stop
                )
            except MissingEndpointError as error:
                raise EndpointError(
                    f"{error}: the server offers no /v1/completions, where --raw sends the prompt "
                    "as it is; drop --raw to send it through the server's chat template"
                ) from None
        else:
            from cli.commands.basemodel import warn_if_base

            warn_if_base(name, "add --raw and give it text to continue")
            if not backend.has_chat_template:
                render.warning_line(
                    "the model has no chat template and no family quill knows; sending the prompt "
                    "as 'user: ...' lines, which base models only continue (--raw sends it as it "
                    "is)"
                )
            messages = [("system", request.system)] if request.system else []
            messages.append(("user", request.prompt))
            events = backend.stream_chat(
                messages, request.max_tokens, request.sampling, request.stop
            )
        try:
            code = _stream(backend, recorder, events, request, name)
            show = request.show_stats and not request.json_output
            # An interrupted run leaves at once: no state is written on the way out.
            finish_prompt_cache(backend, show, keep=code == EXIT_OK)
            return code
        except BrokenPipeError:
            # The reader went away (quill run ... | head): stop quietly, as cat and grep do.
            render.silence_stdout()
            return EXIT_OK
    finally:
        backend.close()


def _plan_at_load(backend: Backend) -> dict[str, Any] | None:
    """The memory plan of the model as it was opened (what quill pull and inspect plan from the
    header alone); None for a server's model."""
    if backend.server_url is not None or backend.kv_type_k is None or backend.kv_type_v is None:
        return None
    from pathlib import Path

    from cli.engine.options import LoadOptions, memory_plan
    from cli.store.header import header_on_disk

    shape = header_on_disk(Path(backend.location)).shape
    options = LoadOptions(backend.n_ctx, kv_type_k=backend.kv_type_k, kv_type_v=backend.kv_type_v)
    return memory_plan(shape, options).as_dict()


def _stream(
    backend: Backend,
    recorder: MetricsRecorder,
    events: Iterator[StreamEvent],
    request: RunRequest,
    model_name: str,
) -> int:
    from cli.ui import render

    pieces: list[str] = []
    thoughts: list[str] = []
    logprobs: list[TokenLogprobs] = []
    thought_open = False  # reasoning was written to stderr without its closing newline
    finish_override = None
    try:
        for event in events:
            pieces.append(event.text)
            thoughts.append(event.reasoning)
            logprobs.extend(event.logprobs or ())
            if not request.json_output:
                if not request.hide_thinking:
                    render.write_reasoning(event.reasoning)
                    thought_open = thought_open or bool(event.reasoning)
                    if thought_open and (event.text or event.finish_reason):
                        render.write_reasoning("\n")  # the reasoning ends its own line
                        thought_open = False
                render.write_stdout(event.text)
            recorder.observe(event)
    except KeyboardInterrupt:
        finish_override = "interrupted"
    metrics = recorder.summary(backend, finish_override)
    text = "".join(pieces)
    if request.json_output:
        reasoning = "".join(thoughts)
        shown = logprobs if request.logprobs is not None else None
        document = render.run_json(
            model_name, backend.location, text, metrics, reasoning, shown, _plan_at_load(backend)
        )
        render.write_stdout(document + "\n")
    else:
        if text and not text.endswith("\n"):  # a reply is a line, on a terminal or in a file
            render.write_stdout("\n")
        if request.timeline:
            stats = backend.speculation_stats
            render.print_timeline(recorder.arrivals(), guessed=stats.guessed if stats else ())
        if request.show_stats:
            render.print_stats(metrics, backend.reports_runtime)
    if request.verbose and backend.perf_note():
        render.info_line(backend.perf_note())
    if request.verbose and request.constraint is not None:
        render.info_line(render.grammar_line(metrics))
    if finish_override:
        return EXIT_INTERRUPTED
    check_output(request.constraint, text, metrics.finish_reason)
    return EXIT_OK

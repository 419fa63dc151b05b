"""quill run: get the model (or a server), stream the reply to stdout, report the numbers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
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
    invocation: typer.Context,
    words: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[MODEL] [PROMPT]",
            show_default=False,
            help="The prompt; text on stdin comes first, then this. Two arguments are a model "
            "(as -m takes it: an alias, a model on disk, a .gguf path) and the prompt, in "
            "Ollama's order. One that names a model is the model, as in ollama run MODEL: the "
            "prompt is then stdin, or at a terminal a chat opens.",
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
    repack: shared.Repack = "auto",
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
    """Generate a reply to PROMPT, streamed to stdout; reasoning and timing go to stderr. A
    MODEL without a prompt, at a terminal, opens a chat with it (quill chat MODEL)."""
    words = words or []
    if len(words) == 1 and model is None and _one_argument_is_model(words[0], endpoint):
        model, words = words[0], []
        if shared.stdin_is_terminal():  # no prompt anywhere: Ollama's `ollama run MODEL`
            _chat_instead(invocation, locals())
            return
    model, prompt = shared.model_and_prompt(words, model)
    constraint = build_constraint(schema, schema_multi, json_format, grammar, strict)
    speculation = spec_options(spec, draft, draft_tokens, endpoint, constraint)
    if logprobs is not None and speculation is not None:
        raise UsageError(
            f"--logprobs cannot go with --spec {spec}: logprobs are read from each token's own "
            "logits, which speculative decoding skips; drop one of them"
        )
    source = shared.model_source(endpoint, api_key, offline, rpc)
    if source.endpoint and (chat_template or think is not None or think_budget is not None):
        raise UsageError(
            "--chat-template, --think and --think-budget apply to a local model; a server "
            "renders its own template (quill serve takes --chat-template and --think)"
        )
    if logprobs is not None and not json_output:
        from cli.ui import render

        render.warning_line("--logprobs shows only in --json output; none are computed without it")
    from cli.measure.paths import Workload
    from cli.store.config import default_model
    from cli.store.promptcache import run_cache
    from cli.ui import render

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
        show_stats=shared.stats_shown(no_stats),
        timeline=timeline,
        verbose=verbose,
        hide_thinking=hide_thinking,
        constraint=constraint,
        logprobs=logprobs,
    )
    # Checked with a server too, as chat checks them: a typo is one line whichever runs the model.
    options = shared.load_options(ctx, threads, gpu_layers, kv_type, kv_k, kv_v, rpc, repack=repack)
    local = None if source.endpoint else options
    work = Workload.of_run((request.system or "") + request.prompt, max_tokens)
    label, backend = shared.open_backend(model, source, local, settings, verbose, repack, work)
    # --json's "model" as the user named it (the default: its alias); the stats line's the one
    # opened: the tag a bare alias resolved to, a file by its name (a path would fill the line).
    name = label if source.endpoint else model or default_model()
    stats_name = render.model_shown(label)
    raise typer.Exit(run_once(request, name, backend, stats_name))


def names_model(word: str) -> bool:
    """Whether run's one argument names a model rather than being the prompt, judged without
    the network: what the two-argument form takes as a model (names_known_model: an alias or
    alias:tag from models.yaml, a model on disk by its store name, an existing .gguf file), or
    what the model parser reads as a models.yaml or Hugging Face model (an Ollama size tag such as
    qwen2.5:0.5b, OWNER/REPO[:QUANT], hf://OWNER/REPO/FILE.gguf), or a missing .gguf file (opening
    it says so, where a prompt would be answered by another model). A file of another kind, or
    text with a space, is a prompt."""
    from cli.errors import QuillError

    if shared.names_known_model(word):
        return True
    if not word or any(character.isspace() for character in word):
        return False
    if word.endswith(".gguf"):
        return True
    try:
        return shared.model_request(word).path is None  # no file: a registry or Hub model
    except QuillError:  # no model of any form
        return False


def _one_argument_is_model(word: str, endpoint: str | None) -> bool:
    """Whether run's one argument is the model (names_model). One that only resembles a model's
    name (llama3, qwen:0.5b) is the unknown-model error with its guess, as with two arguments:
    an Ollama user's model name, answered as a prompt by another model, would mislead. (A
    server's model names are its own: with --endpoint such a word stays the prompt.)"""
    from cli.store.registry import load_registry, names_near

    if names_model(word):
        return True
    if endpoint is None and names_near(word, load_registry(), shared.downloaded_names()):
        shared.model_label(word)  # the unknown-model error, with its "did you mean" (exit 3)
    return False


def _chat_instead(invocation: typer.Context, values: dict[str, Any]) -> None:
    """quill chat, given run's options as run got them (values: run's arguments, the model in
    -m's place). An option only a single reply has (--json, --raw, ...) is refused: the chat
    would drop it unseen."""
    import inspect

    from cli.commands.chat import chat

    # --json is chat's with --list, not a reply as JSON: refused here, as run's other own options.
    takes = set(inspect.signature(chat).parameters) - {"invocation", "json_output"}
    for option in invocation.command.params:
        name = option.name or ""
        typed = getattr(invocation.get_parameter_source(name), "name", "") == "COMMANDLINE"
        if typed and name not in takes and name != "words":
            raise UsageError(
                f"{option.opts[0]} goes with a prompt: quill run {values['model']} without one "
                f"opens a chat, which takes no {option.opts[0]}"
            )
    chat(invocation, **{key: value for key, value in values.items() if key in takes})


def run_once(request: RunRequest, name: str, backend: Backend, label: str) -> int:
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
            code = _stream(backend, recorder, events, request, name, label)
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
    model_name: str,  # --json's
    label: str,  # the stats line's
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
            render.print_stats(metrics, backend.reports_runtime, label)
    if request.verbose and backend.perf_note():
        render.info_line(backend.perf_note())
    if request.verbose and request.constraint is not None:
        render.info_line(render.grammar_line(metrics))
    if finish_override:
        return EXIT_INTERRUPTED
    check_output(request.constraint, text, metrics.finish_reason)
    return EXIT_OK

"""The option kit the commands share: option types declared once, and the builders that turn
options into what the library takes. Importing it is cheap: a builder imports what it needs."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cli.engine.options import ALL_LAYERS, DEFAULT_CTX, LoadOptions
from cli.engine.sampling import SamplingParams
from cli.errors import UsageError

if TYPE_CHECKING:
    from cli.engine.backend import Backend
    from cli.engine.engine import Engine
    from cli.engine.settings import ModelSettings
    from cli.measure.paths import Workload
    from cli.store.models import ModelRequest

DEFAULT_SAMPLING = SamplingParams()  # the CLI shows the engine's own defaults
GPU_BUILD_HINT = (
    'CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=on" pip install --no-cache-dir --force-reinstall '
    "llama-cpp-python (or -DGGML_METAL=on, -DGGML_VULKAN=on)"
)

# Options that several commands take, declared once so that they read the same everywhere.
MODEL_HELP = (
    "The model: alias[:tag] from models.yaml, OWNER/REPO[:QUANT], hf://OWNER/REPO/FILE.gguf, or "
    "a .gguf path. Default: smollm2-135m."
)
ModelOption = Annotated[str | None, typer.Option("-m", "--model", help=MODEL_HELP)]
ModelArgument = Annotated[
    str | None, typer.Argument(help="The model, as -m takes it (default: smollm2-135m).")
]
Threads = Annotated[
    int | None,
    typer.Option(
        "-t",
        "--threads",
        min=1,
        help="Default: physical cores that other work leaves free (measured at load and "
        "while decoding).",
    ),
]
GpuLayers = Annotated[
    str | None,
    typer.Option(
        "--gpu-layers", "-ngl", help="Layers to offload: N or all (default: all on a GPU)."
    ),
]
Rpc = Annotated[
    str | None,
    typer.Option(
        "--rpc",
        metavar="HOST:PORT[,...]",
        help="llama.cpp RPC servers (quill rpc-server) to hold the offloaded layers (default "
        "then: all), split by their memory. Unauthenticated: see docs/scale.md.",
    ),
]
REPACK_MODES = ("auto", "on", "off")
Repack = Annotated[
    str,
    typer.Option(
        "--repack",
        metavar="auto|on|off",
        help="Weight repacking: auto puts each weight type where this CPU runs it faster for "
        "the work at hand (the path table: quill bench --paths); on repacks all it can "
        "(llama.cpp's default); off repacks nothing.",
    ),
]
# run, chat and serve open a model with the same default context (the engine's context_size).
CTX_DEFAULT_HELP = f"Default: {DEFAULT_CTX}, or the model's trained context if that is less."
Ctx = Annotated[
    int | None,
    typer.Option("-c", "--ctx", min=16, help=f"Context window in tokens. {CTX_DEFAULT_HELP}"),
]
# Sampling, as run and chat take it: the engine's own defaults, and ranges checked at parse time.
Temperature = Annotated[
    float, typer.Option("--temperature", "--temp", min=0.0, help="0 means greedy.")
]
TopK = Annotated[int, typer.Option("--top-k", min=0, help="0 turns it off.")]
TopP = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="1 turns it off.")]
MinP = Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="0 turns it off.")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", min=0.0, help="1 turns it off.")]
Seed = Annotated[
    int | None,
    typer.Option("--seed", min=0, help="Sampling seed. Default: a new random one each time."),
]
System = Annotated[str | None, typer.Option("-s", "--system", help="System prompt.")]
MaxTokens = Annotated[
    int, typer.Option("-n", "--max-tokens", min=1, help="Most tokens to generate in a reply.")
]
Stop = Annotated[
    list[str] | None,
    typer.Option("--stop", help="Stop when this text appears (repeatable); it is not printed."),
]
NoStats = Annotated[bool, typer.Option("--no-stats", help="Do not print the stats line.")]
KV_TYPE_HELP = "KV-cache type for K and V: f16, q8_0 or q4_0 (also bf16, f32, q4_1, q5_0, q5_1)."
KvType = Annotated[str, typer.Option("--kv-type", help=KV_TYPE_HELP)]
KvK = Annotated[str | None, typer.Option("--kv-k", help="K cache type (overrides --kv-type).")]
KvV = Annotated[
    str | None,
    typer.Option(
        "--kv-v", help="V cache type (overrides --kv-type); quantized V turns on flash attention."
    ),
]
Offline = Annotated[
    bool, typer.Option("--offline", help="Use only models already on disk; no network.")
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log.")]
Endpoint = Annotated[
    str | None,
    typer.Option(
        "--endpoint",
        help="An OpenAI-compatible server (e.g. http://127.0.0.1:8080/v1) instead of a local "
        "model; the model named is the server's model name.",
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar="QUILL_API_KEY", help="Bearer token for --endpoint."),
]
JsonOutput = Annotated[bool, typer.Option("--json", help="One JSON object on stdout.")]
MarkdownOutput = Annotated[bool, typer.Option("--markdown", help="A Markdown table on stdout.")]


def model_name(argument: str | None, option: str | None) -> str | None:
    """The model a command was given, as its positional NAME or as -m/--model (not both)."""
    if argument is not None and option is not None and argument != option:
        raise UsageError(f"two models given ({argument!r} and -m {option!r}): give one")
    return option if option is not None else argument


def downloaded_names() -> list[str]:
    from cli.store.home import quill_home
    from cli.store.models import load_manifest

    return [download.name for download in load_manifest(quill_home())]


def names_known_model(name: str) -> bool:
    """Whether name is a model quill resolves without guessing: a models.yaml alias (alias:tag),
    a model on disk by its store name, or an existing .gguf file. `quill run A B` takes A as the
    model only then, so a two-word prompt never becomes a download."""
    from cli.store.registry import load_registry

    try:
        if name.endswith(".gguf") and Path(name).expanduser().is_file():
            return True
    except (OSError, ValueError, RuntimeError):  # too long for a path, a NUL, ~nosuchuser
        return False
    return name.partition(":")[0] in load_registry().models or name in downloaded_names()


def model_and_prompt(words: list[str], option: str | None) -> tuple[str | None, str | None]:
    """(model, prompt) from run's positionals and -m: `quill run PROMPT`, or Ollama's order
    `quill run MODEL PROMPT...` when MODEL names a model quill knows (the words after it are
    joined, as Ollama joins them)."""
    from cli.store.registry import load_registry, names_near

    if len(words) < 2:
        return option, words[0] if words else None
    if option is None and names_known_model(words[0]):
        return words[0], " ".join(words[1:])
    quoted = shown_text(" ".join(words), 30)[1:-1]
    if option is not None:
        raise UsageError(
            f"{len(words)} arguments, but -m names the model and a prompt is one: quote it (quill "
            f'run -m {option} "{quoted}")'
        )
    if names_near(words[0].partition(":")[0], load_registry(), downloaded_names()):
        model_label(words[0])  # the unknown-model error, with its "did you mean" (exit 3)
    raise UsageError(
        f"{shown_text(words[0])} is not a model quill knows, and a prompt is one argument: quote "
        f'the whole prompt (quill run "{quoted}") or name a model first (quill run MODEL PROMPT)'
    )


def shown_text(text: str, most: int = 80) -> str:
    """A text as an error message quotes it, cut to a readable length."""
    return repr(text) if len(text) <= most else repr(text[: most - 3] + "...")


# llama.cpp's own limits on what the options become: past them a number is silently cut to
# 32 bits (another seed, another top-k) or crashes the process (threads past ggml's 512).
MAX_TOP_K = 2**31 - 1  # an int32
MAX_SEED = 2**32 - 2  # a uint32, and 2**32 - 1 is LLAMA_DEFAULT_SEED: a random seed
MAX_THREADS = 512  # GGML_MAX_N_THREADS
MAX_CTX = 1 << 24  # past any model's trained context (the longest, 10M tokens)


def shown_number(value: int | str) -> str:
    """A number as an error message shows it: a 400-digit one cut to a readable length."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def check_at_most(option: str, value: int | None, most: int, why: str) -> None:
    if value is not None and value > most:
        raise UsageError(f"{option} {shown_number(value)} is more than {most} ({why})")


def check_threads(threads: int | None) -> None:
    """--threads within llama.cpp's bound: past it ggml crashes the process."""
    check_at_most("--threads", threads, MAX_THREADS, "llama.cpp runs at most 512 threads")


def size_option(option: str, text: str) -> int:
    """A size a user typed for option (--cache-max, --cache-ram, --mem), in bytes."""
    from quant.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise UsageError(f"{option}: {error}") from None


def sampling_params(
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    repeat_penalty: float,
    seed: int | None,
    ignore_eos: bool = False,
) -> SamplingParams:
    floats = dict(temperature=temperature, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty)
    for name, number in floats.items():
        if not math.isfinite(number):  # nan passes typer's range checks: every comparison fails
            raise UsageError(f"--{name.replace('_', '-')} takes a finite number, not {number}")
    check_at_most("--top-k", top_k, MAX_TOP_K, "llama.cpp's top-k is a 32-bit integer")
    check_at_most("--seed", seed, MAX_SEED, "llama.cpp's seeds are 32-bit")
    return SamplingParams(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repeat_penalty=repeat_penalty,
        seed=seed,
        ignore_eos=ignore_eos,
    )


def parse_gpu_layers(value: str | None) -> int | None:
    if value is None:
        return None
    if value == "all":
        return ALL_LAYERS
    if value.isdecimal() and value.isascii():
        digits = value.lstrip("0") or "0"
        if len(digits) > 9:  # an int32 to llama.cpp, and far past any model's layer count
            raise UsageError(
                f"--gpu-layers {shown_number(value)} is more layers than any model has: use all"
            )
        return int(digits)
    raise UsageError(f"--gpu-layers takes a number of layers or 'all', not {value!r}")


def parse_rpc(value: str | None) -> tuple[str, ...]:
    """--rpc's HOST:PORT[,HOST:PORT...], checked for shape (cli/engine/rpc.py checks each server
    before llama.cpp is given it)."""
    if value is None:
        return ()
    endpoints = []
    for item in value.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not (sep and host and port.isdecimal() and port.isascii() and 0 < int(port) < 65536):
            raise UsageError(
                f"--rpc takes HOST:PORT[,HOST:PORT...] (e.g. 192.168.1.20:50052), "
                f"not {shown_text(item.strip() or value)}"
            )
        endpoints.append(f"{host}:{int(port)}")
    if len(set(endpoints)) != len(endpoints):
        raise UsageError(f"--rpc names a server twice: {shown_text(value)}")
    return tuple(endpoints)


@dataclass(frozen=True)
class ModelSource:
    """Where run, chat and bench find their model: a server at endpoint (asked with api_key), or
    this machine (offline: only models already on disk)."""

    endpoint: str | None
    api_key: str | None
    offline: bool

    def served_name(self, name: str | None) -> str:
        """The model to ask the server for: the one named, else the first the server lists."""
        from cli.api.client import first_model

        assert self.endpoint is not None, "a model on this machine has no server to ask"
        return name or first_model(self.endpoint, self.api_key) or "default"


def model_source(
    endpoint: str | None,
    api_key: str | None,
    offline: bool,
    rpc: str | None = None,
    configured: bool = True,
) -> ModelSource:
    """The options that say where the model is, refused with --rpc's servers, which hold a model
    loaded here; configured: with no --endpoint, the user's default endpoint (run and chat)."""
    if rpc and endpoint:
        raise UsageError(
            "--rpc splits a model loaded here over RPC servers, and --endpoint sends the "
            "request to a server that loads its own: choose one"
        )
    if endpoint is None and not rpc and configured:
        from cli.store.config import in_force

        default = in_force("endpoint").value  # QUILL_ENDPOINT, or config.toml's
        endpoint = default if isinstance(default, str) else None
    return ModelSource(endpoint, api_key, offline)


@dataclass(frozen=True)
class OutputFormat:
    """What a command writes on stdout: its text or table for a person (all False), or one
    format for programs."""

    json: bool = False
    csv: bool = False
    markdown: bool = False


def output_format(
    json_output: bool, csv_output: bool | None = None, markdown_output: bool | None = None
) -> OutputFormat:
    """The format --json, --csv and --markdown chose (None: an option the command lacks), refused
    when more than one is given."""
    offered = {"--json": json_output, "--csv": csv_output, "--markdown": markdown_output}
    flags = [flag for flag, given in offered.items() if given is not None]
    if sum(bool(given) for given in offered.values()) > 1:
        raise UsageError(f"choose one of {', '.join(flags[:-1])} and {flags[-1]}")
    return OutputFormat(json=json_output, csv=bool(csv_output), markdown=bool(markdown_output))


def resolve_gpu_layers(requested: int | None, rpc: tuple[str, ...] = ()) -> int:
    """Layers to offload: all where a GPU or RPC servers can take them, unless asked otherwise;
    0, with a warning that says how to get a GPU build, where nothing can."""
    from cli.engine.hardware import ANY_GPU, gpu_memory
    from cli.ui import render

    # Not llama_supports_gpu_offload(): an RPC build says yes to it on a machine without a GPU.
    supported = bool(rpc) or bool(gpu_memory(ANY_GPU))
    if requested is None:
        return ALL_LAYERS if supported else 0
    if requested != 0 and not supported:
        render.warning_line(
            "this llama-cpp-python build cannot offload to a GPU, so quill runs on the CPU; "
            f"for a GPU build: {GPU_BUILD_HINT}"
        )
        return 0
    return requested


def kv_types(kv_type: str, kv_k: str | None, kv_v: str | None) -> tuple[str, str]:
    from quant.kv import check_kv_types

    type_k, type_v = kv_k or kv_type, kv_v or kv_type
    try:
        check_kv_types(type_k, type_v)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return type_k, type_v


def load_options(
    ctx: int | None,
    threads: int | None,
    gpu_layers: str | None,
    kv_type: str,
    kv_k: str | None,
    kv_v: str | None,
    rpc: str | None = None,
    parallel: int = 1,
    repack: str = "auto",
) -> LoadOptions:
    """The engine's LoadOptions from the options run, chat, serve and perplexity share (with
    repack "auto", place_weights makes the placement once the model's file is here)."""
    check_threads(threads)
    if repack not in REPACK_MODES:
        raise UsageError(f"--repack takes auto, on or off; got {repack!r}")
    if ctx is not None and ctx * parallel > MAX_CTX:
        what = f"--ctx {shown_number(ctx)}"
        if parallel != 1:
            what += f" × --parallel {parallel}"
        raise UsageError(
            f"{what} is more than {MAX_CTX} tokens, past any model's trained context: "
            "give a smaller --ctx"
        )
    type_k, type_v = kv_types(kv_type, kv_k, kv_v)
    endpoints = parse_rpc(rpc)
    return LoadOptions(
        n_ctx=ctx,
        threads=threads,
        gpu_layers=resolve_gpu_layers(parse_gpu_layers(gpu_layers), endpoints),
        rpc=endpoints,
        kv_type_k=type_k,
        kv_type_v=type_v,
        parallel=parallel,
        repack=repack != "off",
    )


def place_weights(
    path: Path, options: LoadOptions, repack: str = "auto", work: Workload | None = None
) -> LoadOptions:
    """options with the model's weights placed for work (default: a chat turn) as --repack
    says (cli/measure/paths.py's placed), a measurement of the path table said on stderr."""
    from cli.measure.paths import CHAT, placed
    from cli.ui import render

    def said(line: str) -> None:
        render.info_line(f"{line}; quill bench --paths shows the table")

    return placed(path, options, repack, work or CHAT, said)


def stats_shown(no_stats: bool) -> bool:
    """Whether the stats line shows: not with --no-stats, nor where the user's stats setting
    (QUILL_STATS, config.toml) is false."""
    from cli.store.config import in_force

    return not no_stats and in_force("stats").value is not False


def model_request(name: str | None) -> ModelRequest:
    """What a model name asks for (None: the default model), without obtaining it."""
    from cli.store.config import default_model
    from cli.store.models import parse_model_name
    from cli.store.registry import load_registry

    return parse_model_name(name or default_model(), load_registry())


def model_label(name: str | None) -> str:
    return model_request(name).label


def obtain_request(request: ModelRequest, offline: bool, verbose: bool = False) -> Path:
    """The local path of a requested model, downloaded (with a progress bar) if needed."""
    from cli.store.models import obtain
    from cli.ui import render
    from cli.ui.progress import download_progress

    return obtain(
        request,
        offline=offline,
        report=render.info_line,
        progress=download_progress(),
        verbose=verbose,
    )


def obtain_model(name: str | None, offline: bool, verbose: bool = False) -> tuple[str, Path]:
    """(label, local path) for a model name (None: the default), downloaded if needed."""
    request = model_request(name)
    return request.label, obtain_request(request, offline, verbose)


def open_model(
    name: str | None,
    options: LoadOptions,
    settings: ModelSettings,
    offline: bool,
    verbose: bool = False,
    repack: str = "auto",
    work: Workload | None = None,
) -> tuple[str, Engine]:
    """(label, engine): the one way run and chat (at start and at /model) open a local model.
    The model and its draft are obtained like any model, its weights placed for work
    (place_weights), the template family models.yaml names for it comes along, and the engine
    gets all of it when it is built."""
    from cli.commands.templating import registry_family
    from cli.engine.opening import open_engine
    from cli.ui import render

    label, path = obtain_model(name, offline, verbose)
    options = place_weights(path, options, repack, work)
    draft = None
    if settings.spec is not None and settings.spec.draft is not None:
        draft = obtain_model(settings.spec.draft, offline, verbose)
    if verbose:  # what the weights and KV cache take; a draft's come on top of the model's
        from dataclasses import replace

        from cli.engine.options import context_size, memory_plan
        from cli.store.header import header_on_disk

        shape = header_on_disk(path).shape  # a header past llama.cpp's limits: one line, exit 5
        render.info_line(render.memory_line(memory_plan(shape, options)))
        if draft is not None:  # at the model's context
            at_model_ctx = replace(options, n_ctx=context_size(options.n_ctx, shape.trained_ctx))
            memory = memory_plan(header_on_disk(draft[1]).shape, at_model_ctx)
            render.info_line(f"draft {draft[0]}: {render.memory_line(memory)}")

    family = registry_family(name)
    engine = open_engine(path, options, settings, verbose, family, draft, warn_note)
    if not engine.continues_text:
        engine.close()
        refuse_other_kinds(label, path)
    return label, engine


def refuse_other_kinds(label: str, path: Path) -> None:
    """A model that does not continue text (Engine.continues_text): one line saying what it is
    for, from its header (read only here: a chat model's start does not pay for it)."""
    from quant.gguf import file_kind

    kind = file_kind(path)
    if kind == "embedding":
        raise UsageError(
            f"{label} is an embedding model: it makes vectors, not text; use quill embed"
        )
    if kind == "rerank":
        raise UsageError(f"{label} is a reranker: it scores documents, not text; use quill rerank")
    raise UsageError(
        f"{label} reads whole texts (its attention is not causal): it does not generate"
    )


def warn_note(note: str) -> None:
    """A note the engine tells while it opens a model (open_engine's on_note), as a warning line
    in the options' words."""
    from cli.commands.wording import note_words
    from cli.ui import render

    render.warning_line(note_words(note))


def open_backend(
    name: str | None,
    source: ModelSource,
    options: LoadOptions | None,  # None with an endpoint
    settings: ModelSettings,
    verbose: bool = False,
    repack: str = "auto",
    work: Workload | None = None,
) -> tuple[str, Backend]:
    """(label, backend): the model a server at the source's endpoint serves as name (None: its
    first), else the local model as open_model opens it."""
    if source.endpoint:
        from cli.api.client import RemoteModel

        label = source.served_name(name)
        return label, RemoteModel(
            source.endpoint, label, source.api_key, logprobs=settings.logprobs
        )
    assert options is not None
    return open_model(name, options, settings, source.offline, verbose, repack, work)


def stdin_is_terminal() -> bool:
    return sys.stdin.isatty()


def read_prompt(argument: str | None) -> str:
    """Stdin (when it is not a terminal), then the argument after a blank line, as llm joins
    them. The piped document first: two questions about one file then share its tokens as a
    prefix, and the second run takes them from the prompt cache instead of prefilling again."""
    parts = []
    if not sys.stdin.isatty():
        piped = sys.stdin.buffer.read().decode("utf-8", errors="replace")
        if piped.strip():
            parts.append(piped.rstrip("\n"))
    if argument:
        parts.append(argument)
    if not parts:
        raise UsageError('no prompt: give one as an argument (quill run "...") or on stdin')
    return "\n\n".join(parts)

"""quill serve: the OpenAI-compatible API from a local model, with continuous batching."""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cli.commands import options as shared
from cli.commands.cache import DEFAULT_CACHE_MAX, CacheMax
from cli.commands.templating import ChatTemplateFile, Think, read_template_option
from cli.engine.options import DEFAULT_BATCH
from cli.errors import UsageError

if TYPE_CHECKING:
    import socket

    from cli.api.http import HttpLimits
    from cli.api.pool import ModelPool, PoolAdvice, Scheduler
    from cli.api.server import ServerLimits
    from cli.engine.embedqueue import EmbeddingScheduler
    from cli.engine.options import LoadOptions
    from cli.engine.settings import ModelSettings

SERVE_EPILOG = (
    "Endpoints: POST /v1/chat/completions, POST /v1/completions (stream or not), GET /v1/models, "
    "POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), POST "
    "/v1/responses with GET and DELETE /v1/responses/ID (OpenAI's Responses API), POST "
    "/v1/embeddings and POST /v1/rerank (embedding and reranker models), POST /tokenize and "
    "/detokenize, GET /metrics (with --metrics), GET /health, GET /api/ps (quill ps), POST "
    "/models/unload (quill stop), POST /slots/ID. The first MODEL "
    "(default: smollm2-135m) is loaded at start and kept; the others, and every model on disk "
    "when no MODEL is named or with --any-model, load when a request's model field names them "
    "and unload --keep-alive after their last request. "
    "SIGTERM or Ctrl-C drains the server: no new requests, those in flight get all but the "
    "last second of --drain-timeout to finish, then exit 0."
)


def _pool_advice() -> PoolAdvice:
    """What a client the model pool refuses is told to do, in serve's options."""
    from cli.api.pool import PoolAdvice

    return PoolAdvice(
        models_busy="retry later, or start the server with a higher --max-models",
        model_too_large="start it with a larger --memory-limit, a smaller --ctx or --parallel, "
        "or use a smaller quant",
    )


def serve(
    names: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[MODEL]...",
            help="The models, as -m takes them (default: smollm2-135m, loaded at start, and "
            "every model on disk when a request names it).",
        ),
    ] = None,
    model: shared.ModelOption = None,
    any_model: Annotated[
        bool,
        typer.Option(
            "--any-model",
            help="With MODELs named, also serve every model on disk (quill list), loaded when a "
            "request names it; with none, load none at start.",
        ),
    ] = False,
    keep_alive: Annotated[
        str,
        typer.Option(
            "--keep-alive",
            help="How long a model loaded on demand stays after its last request (e.g. 30s, "
            "5m, 1h; -1: until evicted). A request's keep_alive field overrides it.",
        ),
    ] = "5m",
    max_models: Annotated[
        int,
        typer.Option(
            "--max-models", min=0, help="Models loaded at once (0: as many as memory allows)."
        ),
    ] = 0,
    memory_limit: Annotated[
        str | None,
        typer.Option(
            "--memory-limit",
            help="Memory the loaded models may plan to take together (e.g. 8GiB). Default: the "
            "memory available at start.",
        ),
    ] = None,
    alias: Annotated[
        list[str] | None,
        typer.Option(
            "--alias",
            "-a",
            metavar="NAME",
            help="A name for the first MODEL (repeatable, or several separated by commas, as "
            "llama-server's): /v1/models lists it by the first, and requests may name any.",
        ),
    ] = None,
    strict_model: Annotated[
        bool,
        typer.Option(
            "--strict-model",
            help="Refuse (404) a request naming a model this server does not have, with one "
            "model too. Default: a one-model server answers whatever model a request names "
            "(as llama-server; clients send placeholders such as gpt-3.5-turbo); with several, "
            "an unknown name is always a 404.",
        ),
    ] = False,
    temperature: Annotated[
        float | None,
        typer.Option(
            "--temp",
            "--temperature",
            min=0,
            max=2,
            help="Temperature of requests that set none (default 0.8; 0: greedy).",
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            "-s",
            min=-1,
            max=2**32 - 2,
            help="Seed of requests that set none (-1 or unset: a random seed each).",
        ),
    ] = None,
    n_predict: Annotated[
        int | None,
        typer.Option(
            "--n-predict",
            "-n",
            min=-1,
            help="Tokens a request generates when it says none (-1: up to its context). "
            "Default: 512.",
        ),
    ] = None,
    host: Annotated[
        list[str] | None,
        typer.Option(
            "--host",
            help="Address to listen on (0.0.0.0: every interface); repeat it, or give several "
            "separated by commas, to listen on each. Default: 127.0.0.1.",
        ),
    ] = None,
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port.")] = 8080,
    parallel: Annotated[
        int, typer.Option("--parallel", "-np", min=1, help="Requests decoded together.")
    ] = 4,
    ctx: Annotated[
        int | None,
        typer.Option(
            "-c",
            "--ctx",
            "--ctx-size",
            min=16,
            help="Context per request (each slot's), in tokens; llama-server's -c is the total "
            f"its slots share. {shared.CTX_DEFAULT_HELP}",
        ),
    ] = None,
    batch_size: Annotated[
        int,
        typer.Option(
            "-b",
            "--batch-size",
            min=1,
            help="Most tokens decoded in one step, prompts' and replies' together (at most "
            "--ctx): smaller steps keep replies flowing while a long prompt prefills.",
        ),
    ] = DEFAULT_BATCH,
    slots_listed: Annotated[
        bool,
        typer.Option(
            "--slots/--no-slots",
            help="Answer GET /slots (each slot and whether it is busy; never the prompts).",
        ),
    ] = True,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="QUILL_API_KEY",
            help="Require the key: 'Authorization: Bearer KEY' or 'x-api-key: KEY'.",
        ),
    ] = None,
    metrics: Annotated[
        bool,
        typer.Option(
            "--metrics",
            help="Answer GET /metrics: Prometheus's text format (requests, tokens, "
            "TTFT, decode speed, slots, models loaded).",
        ),
    ] = False,
    max_queue: Annotated[
        int, typer.Option("--max-queue", min=0, help="Requests waiting for a slot before 429.")
    ] = 16,
    max_tokens_limit: Annotated[
        int | None,
        typer.Option("--max-tokens-limit", min=1, help="Most tokens a request may ask for."),
    ] = None,
    max_body: Annotated[
        int, typer.Option("--max-body", min=1024, help="Largest request body, in bytes.")
    ] = 1 << 20,
    max_connections: Annotated[
        int,
        typer.Option("--max-connections", min=1, help="Open connections before 429 and close."),
    ] = 1024,
    header_timeout: Annotated[
        float,
        typer.Option(
            "--header-timeout", min=0.1, help="Seconds for a request's line and headers (408)."
        ),
    ] = 10.0,
    body_timeout: Annotated[
        float,
        typer.Option("--body-timeout", min=0.1, help="Seconds for a request's body (408)."),
    ] = 30.0,
    drain_timeout: Annotated[
        float,
        typer.Option(
            "--drain-timeout",
            min=0,
            help="Seconds after SIGTERM or Ctrl-C within which the server exits; requests in "
            "flight get all but the last second to finish.",
        ),
    ] = 30.0,
    cors: Annotated[
        list[str] | None,
        typer.Option(
            "--cors",
            metavar="ORIGIN",
            help="Allow browsers on ORIGIN (repeatable; * for any). Default: no CORS.",
        ),
    ] = None,
    cache_ram: Annotated[
        str,
        typer.Option(
            "--cache-ram",
            help="RAM for slot caches parked when a new conversation takes their slot (e.g. "
            "1GiB; 0: none): a later turn of a parked conversation loads it instead of "
            "prefilling.",
        ),
    ] = "0",
    no_cache: Annotated[
        bool,
        typer.Option(
            "--no-cache",
            help="No KV store on disk: a model unloaded (evicted, stopped, the server ended) "
            "forgets its conversations, and no request loads what quill run or chat kept.",
        ),
    ] = False,
    cache_max: CacheMax = DEFAULT_CACHE_MAX,
    threads: shared.Threads = None,
    gpu_layers: shared.GpuLayers = None,
    rpc: shared.Rpc = None,
    kv_type: shared.KvType = "f16",
    kv_k: shared.KvK = None,
    kv_v: shared.KvV = None,
    repack: shared.Repack = "auto",
    offline: shared.Offline = False,
    verbose: shared.Verbose = False,
    chat_template: ChatTemplateFile = None,
    think: Think = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API, batching concurrent requests."""
    from cli.api.http import QuillApp, run_server
    from cli.api.server import ServerState
    from cli.engine.options import context_size
    from cli.engine.settings import ModelSettings
    from cli.ui import render

    check_api_key(api_key)
    hosts = [part.strip() for value in host or ["127.0.0.1"] for part in value.split(",")]
    alias = [part.strip() for value in alias or [] for part in value.split(",") if part.strip()]
    park_bytes = shared.size_option("--cache-ram", cache_ram)
    store_bytes = None if no_cache else shared.size_option("--cache-max", cache_max)
    limit = shared.size_option("--memory-limit", memory_limit) if memory_limit else None
    options = shared.load_options(
        ctx, threads, gpu_layers, kv_type, kv_k, kv_v, rpc, parallel=parallel, repack=repack
    )
    options = replace(options, n_batch=batch_size)
    check_parallel(parallel, ctx, batch_size)
    max_connections = open_file_room(max_connections)
    http_limits = _http_limits(
        hosts, max_connections, header_timeout, body_timeout, drain_timeout, cors
    )
    inherited = _inherited_socket()
    if _supervises(rpc, inherited):
        raise typer.Exit(_supervise(hosts, port, http_limits, verbose))
    settings = ModelSettings(chat_template=read_template_option(chat_template), think=think)
    keep_alive_s = duration_option("--keep-alive", keep_alive)
    named = list(dict.fromkeys([*(names or []), *([model] if model else [])]))
    everything = any_model or not named
    if not named and not any_model:
        # Bare `quill serve`, as Ollama's: the default model loaded at start, any other on disk
        # when a request names it.
        named = [shared.model_label(None)]
    files = _aliased(dict(shared.obtain_model(n, offline) for n in named), alias)
    catalog = ServeCatalog(
        files, everything, options, settings, max_queue, park_bytes, store_bytes, repack
    )
    pool = _model_pool(catalog, keep_alive_s, max_models, limit)
    pool.aliases = dict.fromkeys(alias[1:], alias[0]) if alias else {}
    pool.strict = strict_model or everything  # serving the whole disk: names must match
    socks = [inherited[0]] if inherited else _listen(hosts, port)
    bound_port = inherited[1] if inherited else socks[0].getsockname()[1]
    # No model named: none is loaded yet, and a request may use any model's context.
    n_ctx = _open_first_model(catalog, pool) if named else context_size(ctx, None)
    limits = _request_limits(n_ctx, max_body, max_tokens_limit, n_predict, temperature, seed)
    shown = ", ".join(files) if named and not any_model else "the models on disk"
    state = ServerState(
        None, shown, limits, api_key, int(time.time()), on_request=render.info_line, pool=pool,
        metrics=metrics, metrics_off_advice="start quill serve with --metrics",
        slots_listed=slots_listed, slots_off_advice="quill serve was started with --no-slots",
    )  # fmt: skip
    if http_limits.allowed_hosts is None and not api_key:  # not bound to a loopback address
        render.warning_line(f"listening on {', '.join(hosts)} without --api-key: {OPEN_TO_ALL}")
    _announce(shown, hosts, bound_port, n_ctx, options, park_bytes)
    try:
        stopped_by = run_server(socks, QuillApp(state, http_limits), http_limits, verbose=verbose)
        if stopped_by is not None:
            render.info_line(f"stopped by {stopped_by}: drained")
    finally:
        pool.close()


OPEN_TO_ALL = "anyone who can reach this port can use it"


def _inherited_socket() -> tuple[socket.socket, int] | None:
    """Where this serve is serve --rpc's child: the socket its parent passed, and the port
    users reach (cli/api/supervisor.py)."""
    if not os.environ.get("QUILL_SERVE_CHILD"):
        return None
    from cli.api.supervisor import child_socket

    return child_socket()


def _supervises(rpc: str | None, inherited: tuple[socket.socket, int] | None) -> bool:
    """serve --rpc, started by the user: it becomes the child's supervisor. Windows cannot pass
    a listening socket to a child: there it stays one process, which a lost RPC server ends
    (exit code 9)."""
    return bool(rpc) and inherited is None and os.name != "nt"


def _supervise(hosts: list[str], port: int, http_limits: HttpLimits, verbose: bool) -> int:
    """serve --rpc: this process listens and passes requests to a child serve that holds the
    models, and starts it again when a lost RPC server ends it (cli/api/supervisor.py)."""
    from cli.api.supervisor import supervise

    socks = _listen(hosts, port)
    return supervise(sys.argv[1:], socks, http_limits, verbose)


def _aliased(files: dict[str, Path], alias: list[str]) -> dict[str, Path]:
    """The models by label, the first under its first --alias."""
    first = next(iter(files), None)
    return {alias[0] if alias and label == first else label: path for label, path in files.items()}


def _request_limits(
    n_ctx: int,
    max_body: int,
    max_tokens_limit: int | None,
    n_predict: int | None,
    temperature: float | None,
    seed: int | None,
) -> ServerLimits:
    """What a request may ask for, and what it gets where it asks for nothing (--n-predict,
    --temp, --seed, as llama-server's)."""
    from cli.api.server import ServerLimits
    from cli.engine.sampling import SamplingParams

    most = max_tokens_limit or n_ctx
    return ServerLimits(
        max_body_bytes=max_body,
        max_tokens=most,
        default_max_tokens=min(n_ctx if n_predict == -1 else n_predict or 512, most),
        default_sampling=SamplingParams(
            temperature=SamplingParams.temperature if temperature is None else temperature,
            seed=None if seed in (None, -1) else seed,
        ),
    )


def _http_limits(
    hosts: list[str],
    max_connections: int,
    header_timeout: float,
    body_timeout: float,
    drain_timeout: float,
    cors: list[str] | None,
) -> HttpLimits:
    """What the server's connections are held to, from serve's options."""
    from cli.api.http import HttpLimits, allowed_hosts_for

    return HttpLimits(
        max_connections=max_connections,
        header_timeout_s=header_timeout,
        body_timeout_s=body_timeout,
        drain_timeout_s=drain_timeout,
        cors_origins=tuple(cors or ()),
        allowed_hosts=allowed_hosts_for(hosts),
    )


def _model_pool(
    catalog: ServeCatalog, keep_alive_s: float, max_models: int, limit: int | None
) -> ModelPool:
    """The pool that loads the catalog's models on demand, within --memory-limit (default: the
    memory available now)."""
    from cli.api.pool import ModelPool
    from cli.commands.models import available_memory
    from cli.ui import render

    return ModelPool(
        catalog,
        keep_alive_s,
        max_models,
        limit if limit is not None else max(room for _, room in available_memory()),
        on_event=render.info_line,
        advice=_pool_advice(),
    )


def _listen(hosts: list[str], port: int) -> list[socket.socket]:
    """A listening socket on each host, all on one port (with --port 0, the one the first got)."""
    from cli.api.http import listen

    socks: list[socket.socket] = []
    for host in hosts:
        try:
            socks.append(listen(host, socks[0].getsockname()[1] if socks else port))
        except OSError as error:
            for sock in socks:
                sock.close()
            where = f"[{host}]" if ":" in host else host
            raise UsageError(
                f"cannot listen on {where}:{port}: {error.strerror}; choose another --port or "
                "--host"
            ) from None
    return socks


def _open_first_model(catalog: ServeCatalog, pool: ModelPool) -> int:
    """Load the first model named, kept in the pool from the start; the context size of the
    slots of the chat models it serves."""
    from cli.engine.engine import Engine

    label, path = next(iter(catalog.files.items()))
    scheduler = catalog.open(label, path)
    pool.add_loaded(label, scheduler, catalog.memory_bytes(path)[0])
    if not isinstance(scheduler.engine, Engine):  # an embedding model: its context is no slot's
        from cli.engine.options import context_size

        return context_size(catalog.options.n_ctx, None)
    return scheduler.engine.n_ctx


def _announce(
    shown: str,
    hosts: list[str],
    bound_port: int,
    n_ctx: int,
    options: LoadOptions,
    park_bytes: int,
) -> None:
    """The line that says the server is up and what it serves, and its port in
    QUILL_SERVE_READY_FILE where that is set."""
    from cli.ui import render
    from cli.units import human_bytes

    kv = f"KV {options.kv_type_k}/{options.kv_type_v}"
    parked = f" · parked caches up to {human_bytes(park_bytes)}" if park_bytes else ""
    render.info_line(
        f"quill serve: {shown} on {', '.join(_url(host, bound_port) for host in hosts)} · "
        f"{options.parallel} slots of {n_ctx} tokens · {kv}{parked} · Ctrl-C to stop"
    )
    if os.environ.get("QUILL_SERVE_READY_FILE"):  # tests and scripts learn the port from here
        with open(os.environ["QUILL_SERVE_READY_FILE"], "w") as ready:
            ready.write(str(bound_port))


def _url(host: str, port: int) -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


class ServeCatalog:
    """The models serve may load (those named, and with --any-model those on disk), how it opens
    one (each with its own batch scheduler), and what the memory plan says one takes."""

    def __init__(
        self,
        files: dict[str, Path],
        any_model: bool,
        options: LoadOptions,
        settings: ModelSettings,
        max_queue: int,
        park_bytes: int,
        store_bytes: int | None = None,
        repack: str = "auto",
    ) -> None:
        """store_bytes: the KV store's bound on disk (None: no store); repack: --repack's mode
        (each model's weights placed for a server's request: cli/measure/paths.py's SERVE)."""
        self.files, self.any_model, self.options, self.settings = (
            files,
            any_model,
            options,
            settings,
        )
        self.max_queue, self.park_bytes, self.store_bytes = max_queue, park_bytes, store_bytes
        self.repack = repack

    def models(self) -> dict[str, Path]:
        found = dict(self.files)
        if self.any_model:
            from cli.store.models import list_local
            from cli.store.registry import load_registry

            registry = load_registry()

            def default_tag_first(name: str) -> tuple[str, bool]:
                alias, _, tag = name.partition(":")
                entry = registry.models.get(alias)
                return alias, entry is None or tag != entry.default_tag

            for local in sorted(list_local(registry), key=lambda m: default_tag_first(m.name)):
                found.setdefault(local.name, local.path)
        return found

    def open(self, label: str, path: Path) -> Scheduler:
        from cli.commands.templating import registry_family
        from cli.engine.batching import BatchScheduler
        from cli.engine.opening import open_engine
        from cli.store.promptcache import conversation_cache
        from cli.ui import render
        from quant.gguf import file_kind

        if file_kind(path) != "generation":
            return self._open_embedder(path)
        family = registry_family(label)
        store = conversation_cache(self.store_bytes) if self.store_bytes else None
        settings = replace(self.settings, prompt_cache=store)
        from cli.measure.paths import SERVE

        options = shared.place_weights(path, self.options, self.repack, SERVE)
        engine = open_engine(path, options, settings, family=family, on_note=shared.warn_note)
        if engine.weights_placement:
            placed = f"weights {engine.weights_placement} (--repack {self.repack})"
            render.info_line(f"{label}: {placed}")
        try:
            return BatchScheduler(
                engine,
                max_queued=self.max_queue,
                park_bytes=self.park_bytes,
                on_note=render.warning_line,
            )
        except BaseException:
            engine.close()
            raise

    def _open_embedder(self, path: Path) -> EmbeddingScheduler:
        """An embedding or rerank model, beside the chat models: its own context and queue."""
        from cli.engine.embedding import Embedder
        from cli.engine.embedqueue import EmbeddingScheduler
        from cli.engine.options import LoadOptions

        options = LoadOptions(
            n_batch=0, threads=self.options.threads, gpu_layers=self.options.gpu_layers
        )
        embedder = Embedder(path, options)
        return EmbeddingScheduler(embedder, max_queued=self.max_queue)

    def memory_bytes(self, path: Path) -> tuple[int, str]:
        """The plan's total for path at this server's context, slots and KV types, and its parts."""
        from cli.engine.options import context_size, memory_plan
        from cli.store.header import header_on_disk
        from cli.units import human_bytes

        shape = header_on_disk(path).shape
        n_ctx, slots = context_size(self.options.n_ctx, shape.trained_ctx), self.options.parallel
        memory = memory_plan(shape, self.options, parked_bytes=self.park_bytes)
        buffers = human_bytes(memory.compute_bytes + memory.output_bytes)
        parts = (
            f"weights {human_bytes(memory.weights_bytes)}, KV cache "
            f"{human_bytes(memory.kv_bytes)} for {slots} slots of {n_ctx} tokens, buffers {buffers}"
        )
        if memory.parked_bytes:
            parts += f", parked caches {human_bytes(memory.parked_bytes)}"
        return memory.total_bytes, parts


def duration_option(option: str, text: str) -> float:
    from cli.api.pool import parse_duration

    try:
        return parse_duration(text)
    except ValueError as error:
        raise UsageError(f"{option}: {error}") from None


def check_parallel(parallel: int, ctx: int | None, n_batch: int = DEFAULT_BATCH) -> None:
    """Refuse a --parallel that llama.cpp would abort on: every decoding sequence puts a token
    with logits into each batch, and a batch holds at most min(--batch-size, --ctx) tokens."""
    import llama_cpp

    from cli.engine.options import context_size

    ctx = context_size(ctx, None)
    batch = min(n_batch, ctx)
    if parallel > batch:
        raise UsageError(
            f"--parallel {parallel} needs a batch of {parallel} tokens, but batches hold "
            f"{batch} (the smaller of --batch-size {n_batch} and --ctx {ctx}): use --parallel "
            f"{batch} or less"
            + (", or raise --ctx" if ctx < n_batch else " or a larger --batch-size")
        )
    most = int(llama_cpp.llama_max_parallel_sequences())
    if parallel > most:
        raise UsageError(
            f"--parallel {parallel} exceeds the {most} sequences llama.cpp can decode together: "
            f"use --parallel {most} or less"
        )


def open_file_room(max_connections: int) -> int:
    """Raise the open-file limit so that --max-connections sockets fit; fewer connections, with a
    warning, where the hard limit does not allow as many."""
    import resource

    from cli.ui import render

    spare = 64  # the model, logs, the listening socket, threads' files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + spare
    if hard != resource.RLIM_INFINITY and wanted > hard:
        max_connections = max(1, hard - spare)
        render.warning_line(
            f"the open-file limit is {hard}: serving at most {max_connections} connections"
        )
        wanted = hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return max_connections


def check_api_key(api_key: str | None) -> None:
    """A key a client can send: an empty one, or one an HTTP header cannot carry as it is
    (spaces at its ends are stripped, only printable ASCII travels), would refuse everyone."""
    if api_key is None:
        return
    if not api_key:
        raise UsageError(
            "--api-key is empty, which no request could match: give a key, or leave the "
            "option out to serve without one"
        )
    if api_key != api_key.strip() or not all(" " <= char <= "~" for char in api_key):
        raise UsageError(
            "--api-key has spaces at its ends or characters outside printable ASCII, which an "
            "'Authorization: Bearer' header cannot carry as they are: choose another key"
        )


ServerEndpoint = Annotated[
    str, typer.Option("--endpoint", help="The quill serve to ask (its URL, with or without /v1).")
]


def ps(
    endpoint: ServerEndpoint = "http://127.0.0.1:8080",
    api_key: shared.ApiKey = None,
    as_json: shared.JsonOutput = False,
) -> None:
    """List the models a running quill serve holds: memory, slots busy, time to unload."""
    import json

    from cli.api.client import server_json
    from cli.units import human_bytes

    models = server_json(endpoint, "/api/ps", api_key).get("models", [])
    if as_json:
        print(json.dumps({"models": models}))
        return
    rows = [("NAME", "SIZE", "SLOTS BUSY", "REQUESTS", "UNTIL")]
    for model in models:
        left = model.get("expires_in_s")
        until = "in use" if model["requests"] else "kept" if left is None else f"{left:.0f} s"
        slots = f"{model['slots_busy']}/{model['slots']}"
        size = human_bytes(model["size"]) if model["size"] else "-"
        rows.append((model["name"], size, slots, str(model["requests"]), until))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def stop(
    name: Annotated[str, typer.Argument(metavar="MODEL", help="The loaded model to unload.")],
    endpoint: ServerEndpoint = "http://127.0.0.1:8080",
    api_key: shared.ApiKey = None,
) -> None:
    """Unload a model from a running quill serve (once its requests in flight finish)."""
    from cli.api.client import server_json
    from cli.ui import render

    answer = server_json(endpoint, "/models/unload", api_key, {"model": name})
    render.info_line(answer.get("message", f"{name} unloaded"))

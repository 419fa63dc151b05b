"""quill serve: the OpenAI-compatible API from a local model, with continuous batching."""

from __future__ import annotations

import os
import time
from typing import Annotated

import typer

from cli.commands import options as shared
from cli.commands.templating import ChatTemplateFile, Think, read_template_option
from cli.errors import UsageError

SERVE_EPILOG = (
    "Endpoints: POST /v1/chat/completions, POST /v1/completions (stream or not), GET /v1/models, "
    "GET /health. SIGTERM or Ctrl-C drains the server: no new requests, those in flight get "
    "all but the last second of --drain-timeout to finish, then exit 0."
)


def serve(
    name: shared.ModelArgument = None,
    model: shared.ModelOption = None,
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port.")] = 8080,
    parallel: Annotated[
        int, typer.Option("--parallel", "-np", min=1, help="Requests decoded together.")
    ] = 4,
    ctx: Annotated[
        int | None,
        typer.Option(
            "-c", "--ctx", min=16, help=f"Context per request, in tokens. {shared.CTX_DEFAULT_HELP}"
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", envvar="QUILL_API_KEY", help="Require 'Authorization: Bearer KEY'."
        ),
    ] = None,
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
    threads: shared.Threads = None,
    gpu_layers: shared.GpuLayers = None,
    kv_type: shared.KvType = "f16",
    kv_k: shared.KvK = None,
    kv_v: shared.KvV = None,
    offline: shared.Offline = False,
    verbose: shared.Verbose = False,
    chat_template: ChatTemplateFile = None,
    think: Think = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API, batching concurrent requests."""
    from cli.api.http import HttpLimits, allowed_hosts_for, listen, run_server
    from cli.api.server import ServerLimits, ServerState
    from cli.engine.batching import BatchScheduler
    from cli.engine.settings import ModelSettings
    from cli.ui import render
    from cli.units import human_bytes

    park_bytes = shared.size_option("--cache-ram", cache_ram)
    options = shared.load_options(ctx, threads, gpu_layers, kv_type, kv_k, kv_v, parallel=parallel)
    check_parallel(parallel, ctx)
    max_connections = open_file_room(max_connections)
    settings = ModelSettings(chat_template=read_template_option(chat_template), think=think)
    try:
        sock = listen(host, port)
    except OSError as error:
        raise UsageError(
            f"cannot listen on {host}:{port}: {error.strerror}; choose another --port"
        ) from None
    label, engine = shared.open_model(shared.model_name(name, model), options, settings, offline)
    scheduler = BatchScheduler(engine, max_queued=max_queue, park_bytes=park_bytes)
    limits = ServerLimits(
        max_body_bytes=max_body,
        max_tokens=max_tokens_limit or engine.n_ctx,
        default_max_tokens=min(512, max_tokens_limit or engine.n_ctx),
    )
    state = ServerState(
        scheduler, label, limits, api_key, int(time.time()), on_request=render.info_line
    )
    http_limits = HttpLimits(
        max_connections=max_connections,
        header_timeout_s=header_timeout,
        body_timeout_s=body_timeout,
        drain_timeout_s=drain_timeout,
        cors_origins=tuple(cors or ()),
        allowed_hosts=allowed_hosts_for(host),
    )
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        render.warning_line(
            f"listening on {host} without --api-key: anyone who can reach this port can use it"
        )
    bound_port = sock.getsockname()[1]
    kv = f"KV {options.kv_type_k}/{options.kv_type_v}"
    parked = f" · parked caches up to {human_bytes(park_bytes)}" if park_bytes else ""
    render.info_line(
        f"quill serve: {label} on http://{host}:{bound_port}/v1 · {parallel} slots of "
        f"{engine.n_ctx} tokens · {kv}{parked} · Ctrl-C to stop"
    )
    if os.environ.get("QUILL_SERVE_READY_FILE"):  # tests and scripts learn the port from here
        with open(os.environ["QUILL_SERVE_READY_FILE"], "w") as ready:
            ready.write(str(bound_port))
    try:
        stopped_by = run_server(sock, state, http_limits, verbose=verbose)
        if stopped_by is not None:
            render.info_line(f"stopped by {stopped_by}: drained")
    finally:
        scheduler.close()
        engine.close()


def check_parallel(parallel: int, ctx: int | None) -> None:
    """Refuse a --parallel that llama.cpp would abort on: every decoding sequence puts a token
    with logits into each batch, and a batch holds at most min(512, --ctx) tokens."""
    import llama_cpp

    from cli.engine.options import DEFAULT_CTX, LoadOptions

    ctx, n_batch = ctx or DEFAULT_CTX, LoadOptions().n_batch
    batch = min(n_batch, ctx)
    if parallel > batch:
        raise UsageError(
            f"--parallel {parallel} needs a batch of {parallel} tokens, but batches hold "
            f"{batch} (the smaller of 512 and --ctx {ctx}): use --parallel {batch} or less"
            + (", or raise --ctx" if ctx < n_batch else "")
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

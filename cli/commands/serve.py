"""quill serve: the OpenAI-compatible API from a local model, with continuous batching."""

from __future__ import annotations

import os
import time
from typing import Annotated

import typer

from cli.commands.options import (
    EXIT_CODES_HELP,
    GpuLayers,
    KvK,
    KvType,
    KvV,
    ModelArgument,
    ModelOption,
    Offline,
    Threads,
    Verbose,
    load_options,
    model_name,
    obtain_model,
)
from cli.errors import UsageError

SERVE_EPILOG = (
    "Endpoints: POST /v1/chat/completions, POST /v1/completions (stream or not), GET /v1/models, "
    "GET /health. Ctrl-C stops the server (exit 0). " + EXIT_CODES_HELP
)


def serve(
    name: ModelArgument = None,
    model: ModelOption = None,
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on (0.0.0.0: every interface).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port.")] = 8080,
    parallel: Annotated[
        int, typer.Option("--parallel", "-np", min=1, help="Requests decoded together.")
    ] = 4,
    ctx: Annotated[
        int, typer.Option("-c", "--ctx", min=16, help="Context per request, in tokens.")
    ] = 2048,
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
    threads: Threads = None,
    gpu_layers: GpuLayers = None,
    kv_type: KvType = "f16",
    kv_k: KvK = None,
    kv_v: KvV = None,
    offline: Offline = False,
    verbose: Verbose = False,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API, batching concurrent requests."""
    from cli.api.server import ServerLimits, ServerState, make_server
    from cli.engine.batching import BatchScheduler
    from cli.engine.engine import Engine
    from cli.ui import render

    options = load_options(ctx, threads, gpu_layers, kv_type, kv_k, kv_v, parallel=parallel)
    type_k, type_v = options.kv_type_k, options.kv_type_v
    label, path = obtain_model(model_name(name, model), offline)
    engine = Engine(path, options, verbose=verbose)
    scheduler = BatchScheduler(engine, max_queued=max_queue)
    limits = ServerLimits(
        max_body_bytes=max_body,
        max_tokens=max_tokens_limit or engine.n_ctx,
        default_max_tokens=min(512, max_tokens_limit or engine.n_ctx),
    )
    state = ServerState(
        scheduler, label, limits, api_key, int(time.time()), on_request=render.info_line
    )
    try:
        server = make_server(host, port, state)
    except OSError as error:
        scheduler.close()
        raise UsageError(
            f"cannot listen on {host}:{port}: {error.strerror}; choose another --port"
        ) from None
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        render.warning_line(
            f"listening on {host} without --api-key: anyone who can reach this port can use it"
        )
    bound_port = server.server_address[1]
    render.info_line(
        f"quill serve: {label} on http://{host}:{bound_port}/v1 · {parallel} slots of "
        f"{engine.n_ctx} tokens · KV {type_k}/{type_v} · Ctrl-C to stop"
    )
    if os.environ.get("QUILL_SERVE_READY_FILE"):  # tests and scripts learn the port from here
        with open(os.environ["QUILL_SERVE_READY_FILE"], "w") as ready:
            ready.write(str(bound_port))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        render.info_line("stopping")
    finally:
        server.server_close()
        scheduler.close()
        engine.close()

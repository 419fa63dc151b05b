"""quill pull, list, rm and inspect: the models on disk and how they get there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from cli.commands.options import (
    JsonOutput,
    KvK,
    KvType,
    KvV,
    Offline,
    Rpc,
    parse_rpc,
    stdin_is_terminal,
)
from cli.errors import Interrupted, ModelNotFoundError, UsageError

if TYPE_CHECKING:
    from pathlib import Path

    from quant.gguf import GGUFHeader
    from quant.memory import DeviceShare

# What pull and inspect say of a base model (models.yaml `base: true`).
BASE_NOTE = "base model, not instruction-tuned: it continues text (quill run --raw)"
KIND_NOTES = {
    "embedding": "embedding model: one vector per text (quill embed, /v1/embeddings)",
    "rerank": "reranker: a relevance score per query and document (quill rerank, /v1/rerank)",
}


def pull(
    name: Annotated[
        str, typer.Argument(help="Alias[:tag], OWNER/REPO[:QUANT] or hf://OWNER/REPO/FILE.gguf.")
    ],
    offline: Annotated[
        bool, typer.Option("--offline", help="Only check the local cache; no network.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show the Hub client's log and pip's output.")
    ] = False,
) -> None:
    """Download a model into the local cache: resumable, checked against its sha256."""
    from cli.commands.options import obtain_request
    from cli.store.models import local_path, parse_model_name
    from cli.store.registry import load_registry, model_kind
    from cli.ui import render
    from cli.units import human_bytes

    request = parse_model_name(name, load_registry())
    if request.path is not None:
        raise UsageError(f"{name} is a local file already; `quill run -m {name}` runs it")
    try:
        path = local_path(request)
        render.info_line(f"{request.label}: already on disk at {path}")
    except ModelNotFoundError:
        try:
            path = obtain_request(request, offline, verbose)
        except KeyboardInterrupt:
            raise Interrupted(
                "interrupted; run the same command again to resume the download"
            ) from None
    size = human_bytes(path.stat().st_size)
    base = f" · {BASE_NOTE}" if model_kind(request.label, load_registry()) == "base" else ""
    render.info_line(f"{request.label}: {size}{base}")


def _file_kind(path: Path) -> str | None:
    """embedding or rerank where the file's header declares a pooling; else None."""
    from quant.gguf import GGUFError, file_kind

    try:
        kind = file_kind(path)
    except (GGUFError, OSError):
        return None
    return None if kind == "generation" else kind


def list_models(
    json_output: Annotated[bool, typer.Option("--json", help="One JSON array on stdout.")] = False,
) -> None:
    """List the models on disk: what quill fetched, and registry models other tools cached."""
    import json

    from cli.store.models import file_quant, list_local
    from cli.store.registry import load_registry, model_kind
    from cli.ui import render

    registry = load_registry()
    models = list_local(registry)
    quants = {str(m.path): m.quant or file_quant(m.path) or "?" for m in models}
    kinds = {
        str(m.path): _file_kind(m.path)
        or model_kind(m.name, registry)
        or model_kind(str(m.path), registry)
        for m in models
    }
    if json_output:
        rows = [
            {
                "name": m.name,
                "quant": quants[str(m.path)],
                "kind": kinds[str(m.path)],
                "size": m.size,
                "source": m.source,
                "owned": m.owned,
                "path": str(m.path),
            }
            for m in models
        ]
        render.write_stdout(json.dumps(rows, indent=1) + "\n")
    elif not models:
        render.info_line("no models on disk yet: `quill pull smollm2-135m` gets the default one")
    else:
        render.models_table(models, quants, kinds)


def rm(
    name: Annotated[str, typer.Argument(help="The model to delete, as `quill list` names it.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
) -> None:
    """Delete a model quill downloaded. Files quill did not fetch or make are never touched."""
    from cli.store.models import local_path, owns, parse_model_name, remove
    from cli.store.registry import load_registry
    from cli.ui import render
    from cli.units import human_bytes

    request = parse_model_name(name, load_registry())
    path = local_path(request)
    if not owns(path):
        remove(request)  # raises the refusal, with its reason
    if not yes:
        if not stdin_is_terminal():
            raise UsageError(f"not deleting {path} without confirmation: add -y")
        size = human_bytes(path.stat().st_size)
        if not typer.confirm(f"Delete {path} ({size})?", err=True):
            raise typer.Exit(1)
    removed = remove(request)
    render.info_line(f"removed {removed.name}: {removed.path} ({human_bytes(removed.size)})")


def inspect(
    name: Annotated[
        str,
        typer.Argument(
            help="alias[:tag], OWNER/REPO[:QUANT], hf://... or a path; a model not on disk "
            "is read from the Hub, its header only."
        ),
    ],
    ctx: Annotated[
        int | None,
        typer.Option("-c", "--ctx", min=1, help="Plan memory for this context (default 4096)."),
    ] = None,
    kv_type: KvType = "f16",
    kv_k: KvK = None,
    kv_v: KvV = None,
    mem: Annotated[
        str | None,
        typer.Option("--mem", help="A memory budget, e.g. 4GiB: the largest context that fits."),
    ] = None,
    cache_ram: Annotated[
        str,
        typer.Option(
            "--cache-ram",
            help="Count parked prompt caches of up to this size, as `quill serve --cache-ram` "
            "keeps them (e.g. 1GiB).",
        ),
    ] = "0",
    draft: Annotated[
        str | None,
        typer.Option(
            "--draft",
            help="Count a draft model for --spec draft, loaded at the same context and KV types.",
        ),
    ] = None,
    offline: Offline = False,
    json_output: JsonOutput = False,
    rpc: Rpc = None,
) -> None:
    """Show what a GGUF file holds and the memory it needs at a context, without loading weights.
    A model not on disk is read from the Hub, its header only; the plan says whether it fits this
    machine's free memory."""
    import json

    from cli.commands.options import MAX_CTX, check_at_most, kv_types, size_option
    from cli.engine.options import LoadOptions, context_size, memory_plan
    from cli.store.models import model_header, parse_model_name
    from cli.store.registry import load_registry, model_kind
    from cli.ui import render
    from quant.memory import largest_context
    from quant.replica import replica_of

    registry = load_registry()
    model = model_header(parse_model_name(name, registry), offline)
    info, shape, header = model.info, model.shape, model.header
    draft_shape = None
    if draft is not None:
        draft_shape = model_header(parse_model_name(draft, registry), offline).shape
    parked = size_option("--cache-ram", cache_ram)
    check_at_most("--ctx", ctx, MAX_CTX, "past any model's trained context")
    type_k, type_v = kv_types(kv_type, kv_k, kv_v)
    budget = size_option("--mem", mem) if mem is not None else None
    n_ctx = context_size(ctx, shape.trained_ctx)
    options = LoadOptions(n_ctx=ctx, kv_type_k=type_k, kv_type_v=type_v)
    memory = memory_plan(shape, options, draft_shape, parked)
    largest = (
        largest_context(shape, budget, type_k, type_v, parked, draft_shape)
        if budget is not None
        else None
    )
    template = _template_facts(header.get("tokenizer.chat_template"), name)
    of = replica_of(header)
    # One word for what the file is for: a replica, an embedding model or reranker (its own
    # header says), else what the registry says of a generation model (instruct or base).
    kind = (
        "replica" if of else info.kind if info.kind != "generation" else model_kind(name, registry)
    )
    available = available_memory()
    split = _rpc_split(header, parse_rpc(rpc), n_ctx, type_k, type_v)
    if json_output:
        data = {**info.as_dict(), **template, "kind": kind, "memory": memory.as_dict()}
        data["replica_of"] = of
        data["header_read_bytes"] = model.read
        data["available"] = [{"memory": where, "bytes": free} for where, free in available]
        if budget is not None:
            data["memory_budget"] = {"bytes": budget, "largest_context": largest}
        if split:
            data["rpc_split"] = [share.as_dict() for share in split]
        render.write_stdout(json.dumps(data, indent=1) + "\n")
    else:
        note = BASE_NOTE if kind == "base" else KIND_NOTES.get(kind or "")
        if of:
            note = f"replica of {of}: its weights are noise, so is its text (quill bench --replica)"
        render.gguf_report(info, template["template_summary"], note, model.read)
        render.memory_report(memory, budget, largest, available)
        if split:
            render.split_report(split)


def _rpc_split(
    header: GGUFHeader, endpoints: tuple[str, ...], n_ctx: int, type_k: str, type_v: str
) -> list[DeviceShare]:
    """Each RPC server's devices asked for their free memory, then llama.cpp's split of every
    layer over them (empty without servers)."""
    from cli.engine.rpc import probe
    from quant.memory import split_plan

    if not endpoints:
        return []
    devices = [device for endpoint in endpoints for device in probe(endpoint)]
    free = [(device.name, device.free_bytes) for device in devices]
    return split_plan(header, free, offloaded=1 << 30, n_ctx=n_ctx, type_k=type_k, type_v=type_v)


def available_memory() -> list[tuple[str, int]]:
    """(where, bytes available): RAM, then each GPU's."""
    import psutil

    from cli.engine.hardware import gpu_memory

    return [("RAM", psutil.virtual_memory().available), *gpu_memory()]


def _template_facts(source: object, name: str) -> dict:
    """The chat template's family and what it supports, from the header (no llama.cpp): the
    file's own template, else the family models.yaml records for the name."""
    from cli.commands.templating import registry_family
    from cli.engine.templates import ChatTemplate, choose_template, template_family

    own = None
    if isinstance(source, str) and source:
        own = ChatTemplate(source, template_family(source), "the model file")
    template = choose_template(own, None, registry_family(name))[0]
    if template is None:
        return {"template_family": None, "template_supports": None, "template_summary": "none"}
    summary = template.describe()
    if template.source is None:
        summary = f"none in the file; {summary} (from {template.origin})"
    return {
        "template_family": template.family,
        "template_supports": {
            "tools": template.supports_tools,
            "thinking": template.supports_thinking,
            "thinking_switch": template.thinking_switch,
        },
        "template_summary": summary,
    }

"""quill pull, list, rm and inspect: the models on disk and how they get there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

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
from cli.errors import Interrupted, ModelNotFoundError, PullDoesNotFitError, UsageError

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from cli.engine.options import LoadOptions
    from cli.measure.fit import FitDecision, Room
    from cli.store.header import ModelHeader
    from cli.store.models import ModelRequest
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
    ctx: Annotated[
        int | None,
        typer.Option(
            "-c", "--ctx", min=16, help="Check the fit at this context (default: run's, 4096)."
        ),
    ] = None,
    mem: Annotated[
        str | None,
        typer.Option(
            "--mem",
            help="Fit within this much memory (e.g. 8GiB) instead of the RAM or GPU memory "
            "available now.",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Download even a model whose plan does not fit.")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Decide and say what would be fetched; fetch nothing."),
    ] = False,
    json_output: JsonOutput = False,
    offline: Annotated[
        bool, typer.Option("--offline", help="Only check the local cache; no network.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show the Hub client's log and pip's output.")
    ] = False,
) -> None:
    """Download a model into the local cache: resumable, checked against its sha256. Its header
    is read first (a few MB): a model whose memory plan does not fit is refused before any weight
    is fetched, and OWNER/REPO alone takes the largest GGUF file that fits with room to spare."""
    from cli.commands.options import MAX_CTX, check_at_most, obtain_request, size_option
    from cli.engine.options import LoadOptions
    from cli.measure.fit import Room
    from cli.store.models import local_path, parse_model_name
    from cli.store.registry import load_registry, model_kind
    from cli.ui import render
    from cli.units import human_bytes

    request = parse_model_name(name, load_registry())
    if request.path is not None:
        raise UsageError(f"{name} is a local file already; `quill run -m {name}` runs it")
    check_at_most("--ctx", ctx, MAX_CTX, "past any model's trained context")
    options = LoadOptions(n_ctx=ctx)
    room = Room("--mem", size_option("--mem", mem)) if mem else Room.largest(available_memory())
    try:
        path: Path | None = local_path(request)
    except ModelNotFoundError:
        path = None
    if path is not None:
        decision: FitDecision | None = _decision_on_disk(request.label, path, options, room)
        render.info_line(f"{request.label}: already on disk at {path}")
    else:
        request, decision = _fit_before_download(request, options, room, offline, verbose)
        _refuse_unless_fits(request.label, decision, json_output, force)
        if dry_run:
            _say_decision(json_output, decision, None)
            return
        try:
            path = obtain_request(request, offline, verbose)
        except KeyboardInterrupt:
            raise Interrupted(
                "interrupted; run the same command again to resume the download"
            ) from None
        decision = decision or _decision_on_disk(request.label, path, options, room)
    _say_decision(json_output, decision, path)
    size = human_bytes(path.stat().st_size)
    base = f" · {BASE_NOTE}" if model_kind(request.label, load_registry()) == "base" else ""
    render.info_line(f"{request.label}: {size}{base}")


def _fit_before_download(
    request: ModelRequest, options: LoadOptions, room: Room, offline: bool, verbose: bool
) -> tuple[ModelRequest, FitDecision | None]:
    """(the request to download, the decision), from the headers of the files a Hub source
    offers; no decision where no header can be read before downloading (a wheel's model)."""
    from dataclasses import replace

    from cli.measure.fit import decide, model_file
    from cli.store.hub import HubSource
    from cli.store.models import ModelRequest
    from cli.store.sources import Fetch, SourceFailed
    from cli.ui import render

    how = Fetch(offline, verbose=verbose)
    predict = _decode_predictor()
    for source in request.sources:
        if not isinstance(source, HubSource):
            continue
        try:
            names = [source.file] if source.file or source.quant_named else source.gguf_files(how)
            files = []
            for file in names:
                one = replace(source, file=file) if file else source
                header = one.header(how)
                files.append(model_file(header.names[0], header, options, room, predict))
        except SourceFailed as failure:
            if len(request.sources) == 1:
                raise
            render.info_line(f"{failure}: the fit is checked once the file is here")
            continue
        decision = decide(request.label, files, room)
        if len(files) > 1:  # from now on, the chosen file of the repository
            chosen = replace(source, file=decision.chosen.file)
            request = ModelRequest(f"{source.repo}:{decision.chosen.quant}", (chosen,))
        return request, decision
    return request, None


def _refuse_unless_fits(
    label: str, decision: FitDecision | None, json_output: bool, force: bool
) -> None:
    from cli.ui import render

    if decision is None:
        return
    if not json_output:
        render.fit_report(decision)
    if not decision.fits and not force:
        chosen, room = decision.chosen, decision.room
        raise PullDoesNotFitError(
            label, chosen.file, chosen.memory.total_bytes, chosen.memory.n_ctx, room.where,
            room.bytes,
        )  # fmt: skip


def _decision_on_disk(label: str, path: Path, options: LoadOptions, room: Room) -> FitDecision:
    from cli.measure.fit import decide, model_file
    from cli.store.header import header_on_disk

    header = header_on_disk(path)
    return decide(label, [model_file(path.name, header, options, room, _decode_predictor())], room)


def _decode_predictor() -> Callable[[ModelHeader], float | None]:
    """Decode tokens/s predicted here for a model, from its header alone (cli/measure/predict.py),
    with the threads run would take now; the first prediction on a machine measures it (seconds,
    once, said on stderr). None where the header gives no prediction."""
    from cli.engine.freecores import measure_free_cores
    from cli.errors import ModelLoadError
    from cli.measure.predict import (
        VECTORS,
        decode_calibration,
        predict_decode,
        weights_read_by_type,
    )
    from cli.ui import render
    from quant.gguf import GGUFError

    threads = measure_free_cores().threads
    said: list[str] = []  # the calibration's line, once

    def predict(model: ModelHeader) -> float | None:
        try:
            types = [kind for kind in weights_read_by_type(model.header) if kind != VECTORS]
            calibration = decode_calibration(threads, types)
            if calibration.seconds and not said:
                said.append(calibration.describe())
                render.info_line(said[0])
            return predict_decode(model.header, threads, calibration=calibration).tokens_per_s
        except (GGUFError, ModelLoadError) as error:
            render.warning_line(f"no decode prediction for {model.where}: {error}")
            return None

    return predict


def _say_decision(json_output: bool, decision: FitDecision | None, path: Path | None) -> None:
    """--json: the decision and where the file is (null: not downloaded), on stdout."""
    import json

    from cli.ui import render

    if json_output:
        data: dict[str, Any] = decision.as_dict() if decision is not None else {"fits": None}
        data["path"] = str(path) if path is not None else None
        render.write_stdout(json.dumps(data, indent=1) + "\n")


def list_models(
    json_output: Annotated[bool, typer.Option("--json", help="One JSON array on stdout.")] = False,
) -> None:
    """List the models on disk: what quill fetched, and registry models other tools cached."""
    import json

    from cli.store.kinds import file_kinds
    from cli.store.models import file_quant, list_local
    from cli.store.registry import load_registry, model_kind
    from cli.ui import render

    registry = load_registry()
    models = list_local(registry)
    quants = {str(m.path): m.quant or file_quant(m.path) or "?" for m in models}
    read = file_kinds(m.path for m in models)
    # A generation model's kind is left blank; the registry names it where the file cannot say.
    kinds = {
        str(m.path): (read[str(m.path)] if read[str(m.path)] != "generation" else None)
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

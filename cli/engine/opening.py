"""The one way a local model is opened with its settings (run, chat at start and at /model,
serve): the engine (a replica said to be one), then its speculator, which needs it loaded (bench
switches with speculate)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.settings import ModelSettings
from cli.engine.speculative import SpecOptions, attach
from quant.replica import REPLICA_KEY


def open_engine(
    path: Path,
    options: LoadOptions,
    settings: ModelSettings,
    verbose: bool = False,
    family: str | None = None,
    draft: tuple[str, Path] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> Engine:
    """The model at path, ready: family is the template family models.yaml names for it, draft
    the (name, file) of settings.spec's draft model."""
    engine = Engine(path, options, verbose, settings, family=family, on_note=on_note)
    replica = engine.meta(REPLICA_KEY)
    if replica is not None:  # quill bench --replica's: whatever opens it must not take its text
        engine.note(
            f"{path.name} is a replica of {replica}: its weights are noise, so is its text; "
            "use it to measure speed and memory"
        )
    if settings.spec is not None:
        speculate(engine, settings.spec, draft, verbose)
    return engine


def speculate(
    engine: Engine,
    spec: SpecOptions | None,
    draft: tuple[str, Path] | None = None,
    verbose: bool = False,
) -> None:
    """Decode with spec from now on (None: plainly), a draft model loaded with the engine's
    context size, threads and KV types; the engine is closed if that fails."""
    try:
        draft_engine = None
        if draft is not None:
            draft_options = LoadOptions(
                n_ctx=engine.n_ctx,
                threads=engine.threads,
                gpu_layers=engine.gpu_layers,
                kv_type_k=engine.kv_type_k,
                kv_type_v=engine.kv_type_v,
            )
            draft_engine = Engine(draft[1], draft_options, verbose)
        attach(engine, spec or SpecOptions("off"), draft_engine, draft[0] if draft else "")
    except BaseException:
        engine.close()
        raise

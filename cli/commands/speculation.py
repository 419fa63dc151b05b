"""The speculative-decoding options run, chat and bench share, and the builder that attaches a
speculator (and its draft model) to a loaded engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from cli.errors import UsageError

if TYPE_CHECKING:
    from cli.engine.engine import Engine

SpecMode = Annotated[
    str,
    typer.Option(
        "--spec",
        help="Speculative decoding: ngram (guess from the prompt and reply so far), draft (a "
        "small model of the same family guesses, see --draft) or off. Greedy text is the same "
        "as without it; sampled text keeps its distribution.",
    ),
]
DraftModel = Annotated[
    str | None,
    typer.Option(
        "--draft", help="The draft model for --spec draft (same tokenizer), as -m takes it."
    ),
]
DraftTokens = Annotated[
    int | None,
    typer.Option(
        "--draft-tokens",
        min=1,
        help="Guess exactly K tokens per step. Default: adaptive (K grows while guesses hold, "
        "and speculation pauses itself while it measures slower than plain decoding).",
    ),
]


def check_spec_flags(
    mode: str, draft: str | None, draft_tokens: int | None, endpoint: str | None = None
) -> None:
    """Refuse contradictory speculation flags before anything is loaded."""
    from cli.engine.speculative import SPEC_MODES

    if mode not in SPEC_MODES:
        raise UsageError(f"--spec takes {', '.join(SPEC_MODES)}, not {mode!r}")
    if draft is not None and mode != "draft":
        raise UsageError("--draft names the draft model of --spec draft: add --spec draft")
    if mode == "draft" and draft is None:
        raise UsageError("--spec draft needs --draft NAME (a small model of the same family)")
    if endpoint and mode != "off":
        raise UsageError("--spec runs on a local model; a server decides its own speculation")
    if draft_tokens is not None and mode == "off":
        raise UsageError("--draft-tokens sets how many tokens --spec guesses: add --spec")


def spec_under_grammar(
    mode: str, draft: str | None, draft_tokens: int | None, constraint: object | None
) -> tuple[str, str | None, int | None]:
    """(mode, draft, draft_tokens) for a reply that --schema, --format or --grammar holds:
    speculation off, said in one line (the grammar must judge each token before the next is
    guessed, and the acceptance test reads the plain chain), and no draft model loaded."""
    if constraint is None or mode == "off":
        return mode, draft, draft_tokens
    from cli.ui import render

    render.warning_line(
        f"--spec {mode} is off under --schema, --format or --grammar: the grammar must judge each "
        "token before the next is guessed, so the reply decodes one token at a time"
    )
    return "off", None, None


def attach_speculation(
    engine: Engine,
    mode: str,
    draft: str | None,
    draft_tokens: int | None,
    offline: bool,
    verbose: bool = False,
) -> None:
    """Give a loaded engine its speculator; a draft model is obtained like any model and loaded
    with the engine's context size, threads and KV types."""
    from cli.engine.speculative import SpecOptions, attach

    options = SpecOptions(mode, draft_tokens)
    if mode != "draft":
        attach(engine, options)
        return
    from cli.commands.options import obtain_model
    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions

    label, path = obtain_model(draft, offline, verbose)
    if verbose:  # the draft's weights and KV cache come on top of the model's
        from cli.ui import render
        from quant.memory import ModelShape, plan

        memory = plan(ModelShape.from_gguf(path), engine.n_ctx, engine.kv_type_k, engine.kv_type_v)
        render.info_line(f"draft {label}: {render.memory_line(memory)}")
    draft_options = LoadOptions(
        n_ctx=engine.n_ctx,
        threads=engine.threads,
        gpu_layers=engine.gpu_layers,
        kv_type_k=engine.kv_type_k,
        kv_type_v=engine.kv_type_v,
    )
    attach(engine, options, Engine(path, draft_options, verbose), label)

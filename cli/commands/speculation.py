"""The speculative-decoding options run, chat and bench share, checked once into SpecOptions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from cli.errors import UsageError

if TYPE_CHECKING:
    from cli.engine.speculative import SpecOptions

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
        help="Guess exactly K tokens per step and never pause. Default: 4 with ngram, up to 8 "
        "with draft (while the draft is sure), paused after a check that held no guess.",
    ),
]


def spec_options(
    mode: str,
    draft: str | None,
    draft_tokens: int | None,
    endpoint: str | None = None,
    constraint: object | None = None,
) -> SpecOptions | None:
    """--spec, --draft and --draft-tokens as one SpecOptions, checked before anything loads;
    None when off, and under --schema, --format or --grammar (said in one line)."""
    from cli.engine.speculative import SpecOptions

    options = SpecOptions(mode, draft_tokens, draft)  # refuses an unknown mode
    if draft is not None and mode != "draft":
        raise UsageError("--draft names the draft model of --spec draft: add --spec draft")
    options.need_draft(draft)
    if endpoint and mode != "off":
        raise UsageError("--spec runs on a local model; a server decides its own speculation")
    if draft_tokens is not None and mode == "off":
        raise UsageError("--draft-tokens sets how many tokens --spec guesses: add --spec")
    if mode == "off":
        return None
    if constraint is not None:
        from cli.ui import render

        render.warning_line(
            f"--spec {mode} is off under --schema, --format or --grammar: the grammar must judge "
            "each token before the next is guessed, so the reply decodes one token at a time"
        )
        return None
    return options

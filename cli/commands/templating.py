"""The chat template and reasoning options that run, chat and serve share; the order a template
is chosen in is cli/engine/templates.py's choose_template."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from cli.errors import UsageError

if TYPE_CHECKING:
    from cli.engine.templates import ChatTemplate

ChatTemplateFile = Annotated[
    str | None,
    typer.Option(
        "--chat-template",
        "--chat-template-file",
        help="A Jinja chat template file to use instead of the model's own, or the name of one "
        "llama.cpp has built in (chatml, llama3, gemma, command-r, ...; as llama-server's "
        "--chat-template NAME).",
    ),
]
Think = Annotated[
    bool | None,
    typer.Option(
        "--think/--no-think",
        help="Turn the template's thinking switch (enable_thinking) on or off; default: the "
        "template's own default.",
    ),
]
ThinkBudget = Annotated[
    int | None,
    typer.Option(
        "--think-budget",
        min=0,
        help="Close the reasoning block after this many thinking tokens, then answer.",
    ),
]


def registry_family(model: str | None) -> str | None:
    """The template family models.yaml records for a model name (alias or alias:tag)."""
    from cli.store.config import default_model
    from cli.store.registry import load_registry

    entry = load_registry().models.get((model or default_model()).partition(":")[0])
    return entry.template if entry else None


def read_template_option(path: str | None) -> ChatTemplate | None:
    """The template a --chat-template file holds, read (and refused if unreadable or
    unparsable) before any model loads; a name that is no file but one of llama.cpp's
    built-in templates is that template."""
    if path is None:
        return None
    from pathlib import Path

    from cli.engine.templates import (
        FAMILIES,
        ChatTemplate,
        builtin_template_names,
        template_from_file,
    )

    if not Path(path).exists():
        names = builtin_template_names()
        if path in names:
            return ChatTemplate(None, path, f"llama.cpp's built-in {path}")
        if "/" not in path and not path.endswith(".jinja"):
            raise UsageError(
                f"the chat template {path} is neither a file nor one of llama.cpp's built-in "
                f"templates ({', '.join(n for n in names if n in FAMILIES)}, and {len(names)} in "
                "all); give a Jinja file or one of those names"
            )
    return template_from_file(path)

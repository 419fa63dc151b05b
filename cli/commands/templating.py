"""The chat template and reasoning options that run, chat and serve share; the order a template
is chosen in is cli/engine/templates.py's choose_template."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from cli.engine.templates import ChatTemplate

ChatTemplateFile = Annotated[
    str | None,
    typer.Option(
        "--chat-template",
        help="A Jinja chat template file to use instead of the model's own (as llama-server's "
        "--chat-template-file).",
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
    from cli.store.registry import load_registry

    registry = load_registry()
    entry = registry.models.get((model or registry.default).partition(":")[0])
    return entry.template if entry else None


def read_template_option(path: str | None) -> ChatTemplate | None:
    """The template a --chat-template file holds, read (and refused if unreadable or
    unparsable) before any model loads."""
    if path is None:
        return None
    from cli.engine.templates import template_from_file

    return template_from_file(path)

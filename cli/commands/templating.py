"""The chat template and reasoning options that run, chat and serve share, and the one place a
loaded engine is given its template: --chat-template FILE, else the file's own, else the family
models.yaml names for it, else the family inferred from the file; said in one line when the
template does not come from the file."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from cli.engine.engine import Engine

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


def check_template_file(path: str | None) -> None:
    """Refuse an unreadable or unparsable --chat-template before any model loads."""
    if path is not None:
        from cli.engine.templates import template_from_file

        template_from_file(path)


def apply_template_choice(
    engine: Engine,
    model: str | None,
    chat_template: str | None = None,
    think: bool | None = None,
    think_budget: int | None = None,
    note=None,
) -> None:
    """Give a loaded engine its template and reasoning settings; note(line) tells the user."""
    from cli.engine.templates import family_template, template_from_file

    if note is not None:
        engine.on_note = note
    current = engine.chat_template
    if chat_template is not None:
        engine.chat_template = template_from_file(chat_template)
    elif current is None or current.source is None:
        family = registry_family(model)
        if family is not None:
            engine.chat_template = family_template(family, "models.yaml")
        chosen = engine.chat_template
        if chosen is not None:
            where = "its models.yaml entry names" if family else "its tokens point to"
            engine.note(
                f"the model file has no chat template; using the {chosen.family} template "
                f"{where} (--chat-template FILE sets another)"
            )
    template = engine.chat_template
    if template is not None and template.family == "gpt-oss":
        engine.note(
            "gpt-oss's channel format is not split into reasoning and answer: both are printed"
        )
    engine.enable_thinking = think
    if think is not None and (template is None or not template.thinking_switch):
        engine.note("the chat template has no thinking switch: --think/--no-think changes nothing")
    engine.think_budget = think_budget

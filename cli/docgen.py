"""docs/reference.md, generated from the Typer app: `python -m cli.docgen > docs/reference.md`
(tests/test_docs.py fails when the file differs, so it cannot fall behind a new flag)."""

from __future__ import annotations

import inspect
from typing import Any

import typer
from typer.core import TyperGroup

HEADER = """\
# Command reference

Every quill command and flag, generated from the program itself (`python -m cli.docgen >
docs/reference.md`; a test fails when this file is out of date). What the numbers mean is in
[metrics](metrics.md); worked examples with real output are linked from the [guide](guide.md).
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def command_context(app: typer.Typer) -> tuple[TyperGroup, Any]:
    """The app's click group and its root context: what the commands and their options are
    read from (each command's module is imported when asked for)."""
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)  # an app of several commands
    return group, _click().Context(group, info_name="quill")


def _click() -> Any:
    return __import__("typer._click", fromlist=["Context"])  # typer's own copy of click


def reference_markdown() -> str:
    from cli.app import app

    click = _click()
    group, root = command_context(app)
    lines = [HEADER]
    commands = group.list_commands(root)
    lines.append("Commands: " + ", ".join(f"[`{name}`](#quill-{name})" for name in commands))
    lines.append("")
    for name in commands:
        command = group.get_command(root, name)
        assert command is not None  # one list_commands named
        context = click.Context(command, info_name=name, parent=root)
        usage = " ".join(command.collect_usage_pieces(context))
        lines += [f"## quill {name}", "", "```text", f"quill {name} {usage}", "```", ""]
        lines += [inspect.cleandoc(command.help or ""), ""]
        rows = []
        for parameter in command.params:
            record = parameter.get_help_record(context)
            if record is None:
                continue
            flags, help_text = record
            rows.append(f"| `{_cell(flags)}` | {_cell(help_text)} |")
        if rows:
            lines += ["| argument or option | meaning |", "|---|---|", *rows, ""]
        if command.epilog:
            lines += [_cell(command.epilog), ""]
    return "\n".join(lines).rstrip() + "\n"


REGISTRY_START = "<!-- the registry's models: cli/docgen.py registry_markdown, from models.yaml -->"
REGISTRY_END = "<!-- end of the registry's models -->"


def registry_markdown() -> str:
    """The registry's models as docs/models.md lists them (tests/test_docs.py keeps it equal)."""
    from cli.store.registry import load_registry
    from cli.store.wheels import WheelSource

    registry = load_registry()
    rows = []
    for alias, entry in registry.models.items():
        tags = ", ".join(f"**{t}**" if t == entry.default_tag else t for t in entry.tags)
        wheel = any(isinstance(s, WheelSource) for t in entry.tags.values() for s in t.sources)
        notes = [
            *(["base model: continues text"] if entry.base else []),
            *(["also from the package index"] if wheel else []),
        ]
        context = f"{entry.context:,}" if entry.context else "?"
        rows.append(
            f"| `{alias}` | {_cell(entry.description)} | {tags} | {context} | {', '.join(notes)} |"
        )
    header = [
        "| alias | model | tags (default in bold) | context | notes |",
        "|---|---|---|---|---|",
    ]
    return "\n".join([REGISTRY_START, *header, *rows, REGISTRY_END]) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")

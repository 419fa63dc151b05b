"""The structured-output options run and chat share (--schema, --schema-multi, --format json,
--grammar, --strict), and what they do around a reply: the grammar into the sampling, the schema
into the system prompt, the finished text checked against the schema."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cli.errors import InvalidOutputError, UsageError

if TYPE_CHECKING:
    from cli.engine.sampling import SamplingParams
    from cli.engine.structured import Constraint

SchemaOption = Annotated[
    str | None,
    typer.Option(
        "--schema",
        help="Reply with JSON that matches this schema: JSON Schema inline, @file.json, or "
        "fields like 'name, age int, bio: one sentence' (types str, int, float, bool).",
    ),
]
SchemaMultiOption = Annotated[
    bool,
    typer.Option("--schema-multi", help='A list of --schema objects, as {"items": [...]}.'),
]
FormatOption = Annotated[
    str | None, typer.Option("--format", help="json: reply with any JSON object.")
]
GrammarOption = Annotated[
    Path | None,
    typer.Option("--grammar", help="Hold the reply to a GBNF grammar file (root rule 'root')."),
]
StrictOption = Annotated[
    bool,
    typer.Option(
        "--strict",
        help="Refuse a schema with keywords the grammar cannot enforce (otherwise they are "
        "named, and checked after).",
    ),
]


def build_constraint(
    schema: str | None,
    schema_multi: bool,
    json_format: str | None,
    grammar: Path | None,
    strict: bool,
) -> Constraint | None:
    """The constraint asked for, checked before any model loads: a schema that cannot become a
    grammar is a usage error, and so is one with unenforceable keywords under --strict."""
    if not (schema or schema_multi or json_format or grammar):
        if strict:
            raise UsageError("--strict applies to a --schema: give one")
        return None
    from cli.engine.structured import constraint_from_options, refuse_unenforced
    from cli.ui import render

    constraint = constraint_from_options(schema, schema_multi, json_format, grammar)
    assert constraint is not None
    if strict:
        refuse_unenforced(constraint)
    elif constraint.unenforced:
        render.warning_line(
            "the grammar cannot enforce "
            + "; ".join(constraint.unenforced)
            + ": the reply is checked against them after (exit 7 if it breaks them)"
        )
    return constraint


def constrained_sampling(sampling: SamplingParams, constraint: Constraint | None) -> SamplingParams:
    if constraint is None:
        return sampling
    if sampling.ignore_eos:
        raise UsageError(
            "--ignore-eos cannot go with a schema or grammar: the reply ends where the grammar does"
        )
    return dataclasses.replace(sampling, grammar=constraint.grammar)


def system_with_schema(system: str | None, constraint: Constraint | None) -> str | None:
    """The system prompt with the schema told to the model (models do better when they see it)."""
    told = constraint.describe_for_prompt() if constraint is not None else ""
    if not told:
        return system
    return f"{system}\n\n{told}" if system else told


def check_output(constraint: Constraint | None, text: str, finish_reason: str | None) -> None:
    """InvalidOutputError (exit 7) saying why, when the finished text does not hold."""
    if constraint is None:
        return
    problem = constraint.problem(text, finish_reason)
    if problem is not None:
        raise InvalidOutputError(problem)

"""The structured-output options of run and chat (--schema, --schema-multi, --format json,
--grammar, --strict) read into a constraint, and what it does around a reply: its grammar in the
sampling, its schema in the system prompt, the finished text checked against it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli.errors import InvalidOutputError, UsageError
from cli.units import shortened

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


# llm's concise syntax: 'name, age int, bio: one sentence'.
CONCISE_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}


def build_constraint(
    schema: str | None,
    schema_multi: bool,
    json_format: str | None,
    grammar: Path | None,
    strict: bool,
) -> Constraint | None:
    """The constraint asked for (at most one of --schema, --format, --grammar), checked before
    any model loads (under --strict, unenforceable keywords are a usage error)."""
    from cli.engine import structured
    from cli.ui import render

    given = [name for name, v in (("--schema", schema), ("--format", json_format),
                                  ("--grammar", grammar)) if v]  # fmt: skip
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} both constrain the output: give one")
    if schema_multi and not schema:
        raise UsageError("--schema-multi wraps a --schema: give one")
    if strict and not given:
        raise UsageError("--strict applies to a --schema: give one")
    if json_format not in (None, "json"):
        raise UsageError(f"--format takes json, not {json_format!r}")
    if grammar:
        return structured.grammar_constraint(read_user_file(grammar, "grammar file"), grammar)
    if not schema:
        return structured.json_object_constraint() if json_format else None
    try:
        constraint = structured.schema_constraint(read_schema(schema, schema_multi), strict)
    except structured.UnenforcedError as error:
        raise UsageError(
            f"--strict: {error} (drop those keywords, or leave out --strict to have the output "
            "checked after)"
        ) from None
    if constraint.unenforced:
        render.warning_line(
            "the grammar cannot enforce "
            + "; ".join(constraint.unenforced)
            + ": the reply is checked against them after (exit 7 if it breaks them)"
        )
    return constraint


def read_schema(spec: str, multi: bool = False) -> dict[str, Any]:
    """A JSON Schema from --schema's forms: inline JSON, @file.json, or the concise form;
    --schema-multi wraps it as {"items": [...]}, as llm does."""
    from cli.engine.structured import MAX_DEPTH, check_schema

    text = spec.strip()
    if text.startswith("@"):
        text = read_user_file(Path(text[1:]), "schema file").strip()
        if not text.startswith("{"):
            shown = shortened(spec[1:])
            raise UsageError(f"the schema file {shown} does not hold a JSON object")
    if text.startswith("{"):
        try:
            schema = json.loads(text)
        except RecursionError:
            raise UsageError(f"the schema nests deeper than {MAX_DEPTH} levels") from None
        except ValueError as error:
            raise UsageError(f"the schema is not valid JSON: {error}") from None
    else:
        schema = concise_schema(text)
    check_schema(schema)
    if not multi:
        return schema
    wrapped = {"type": "object", "properties": {"items": {"type": "array", "items": schema}},
               "required": ["items"]}  # fmt: skip
    # $refs inside the item point at the document root: keep its definitions there.
    return wrapped | {key: schema[key] for key in ("$defs", "definitions") if key in schema}


def concise_schema(spec: str) -> dict[str, Any]:
    """llm's concise syntax: fields split by commas (or newlines when there are any), each
    'name [type][: description]' with type str (default), int, float or bool."""
    properties: dict[str, Any] = {}
    for raw in spec.split("\n" if "\n" in spec else ","):
        entry = raw.strip()
        if not entry:
            continue
        head, _, description = entry.partition(":")
        words = head.split()
        if not words or len(words) > 2:
            raise UsageError(
                f"cannot read the field {entry!r}: write 'name', 'name type' or "
                "'name type: description' (types: str, int, float, bool)"
            )
        name, kind = words[0], words[1] if len(words) == 2 else "str"
        if kind not in CONCISE_TYPES:
            raise UsageError(
                f"unknown type {kind!r} for the field {name!r}: use str, int, float or bool"
            )
        if name in properties:
            raise UsageError(f"the field {name!r} is given twice")
        properties[name] = {"type": CONCISE_TYPES[kind]}
        if description.strip():
            properties[name]["description"] = description.strip()
    if not properties:
        raise UsageError("the schema names no fields")
    return {"type": "object", "properties": properties, "required": list(properties)}


def read_user_file(path: Path, what: str) -> str:
    """The text of a schema or grammar file the user named, or one line saying why not."""
    from cli.engine.gbnf import MAX_GRAMMAR_CHARS
    from cli.userfiles import read_user_text

    limit = 4 * MAX_GRAMMAR_CHARS  # read no more than the grammar budget could take
    return read_user_text(path, what, limit, "past quill's grammar budget")


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


def output_problem(constraint: Constraint, text: str, finish_reason: str | None) -> str | None:
    """Why the finished text does not hold, in the options' words (None when it holds)."""
    if finish_reason == "length":
        return f"the output was cut by --max-tokens before {constraint.what} was complete"
    return constraint.problem(text, finish_reason)


def check_output(constraint: Constraint | None, text: str, finish_reason: str | None) -> None:
    """InvalidOutputError (exit 7) saying why, when the finished text does not hold."""
    problem = output_problem(constraint, text, finish_reason) if constraint else None
    if problem is not None:
        raise InvalidOutputError(problem)

"""Structured output in a request body: OpenAI's response_format (json_object, json_schema with
strict) and llama-server's json_schema and grammar fields, turned into the grammar the request's
sequence samples under. A schema that cannot become a grammar is a 400 with the reason."""

from __future__ import annotations

import json
from typing import Any

from cli.engine.gbnf import GrammarBudgetError
from cli.engine.structured import (
    Constraint,
    SchemaError,
    UnenforcedError,
    check_schema,
    grammar_constraint,
    json_object_constraint,
    schema_constraint,
)

# A grammar (or schema) is parsed by llama.cpp for every request: bound what one may send.
MAX_GRAMMAR_CHARS = 64 * 1024


def constraint_from_body(body: dict[str, Any], bad_request) -> Constraint | None:
    """The constraint a request asks for (None: free text); bad_request(message, param) makes
    the ApiError a refusal raises."""
    asked = [key for key in ("response_format", "json_schema", "grammar") if body.get(key)]
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_request(f"{' and '.join(asked)} both constrain the output: send one", asked[1])
    key = asked[0]
    try:
        if key == "grammar":
            grammar = body["grammar"]
            if not isinstance(grammar, str):
                raise bad_request("'grammar' must be a GBNF string", "grammar")
            _bounded(grammar, "grammar", bad_request)
            return grammar_constraint(grammar)
        if key == "json_schema":
            return _schema(body["json_schema"], "json_schema", False, bad_request)
        return _response_format(body["response_format"], bad_request)
    except UnenforcedError as error:  # only a strict schema raises it
        raise bad_request(f"strict: {error}", key) from None
    except (SchemaError, GrammarBudgetError) as error:
        raise bad_request(str(error), key) from None


def _response_format(value: Any, bad_request) -> Constraint | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a type", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        if "schema" in value:  # llama-server's extension
            return _schema(value["schema"], "response_format", False, bad_request)
        return json_object_constraint()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                "response_format",
            )
        return _schema(spec["schema"], "response_format", bool(spec.get("strict")), bad_request)
    raise bad_request(
        f"response_format type {kind!r} is not one of text, json_object, json_schema",
        "response_format",
    )


def _schema(schema: Any, param: str, strict: bool, bad_request) -> Constraint:
    if not isinstance(schema, dict):
        raise bad_request("a JSON Schema is a JSON object", param)
    _bounded(json.dumps(schema), param, bad_request)
    check_schema(schema)
    return schema_constraint(schema, strict)


def _bounded(text: str, param: str, bad_request) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"'{param}' is over {MAX_GRAMMAR_CHARS} characters", param)

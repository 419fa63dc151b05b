"""Structured output: a JSON Schema, any JSON object, or a GBNF grammar becomes a Constraint: the
checked grammar the sampler holds the model to (cli/engine/schema_grammar.py, cli/engine/gbnf.py),
the keywords it cannot enforce, and the check of the finished text (the jsonschema package)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.engine.gbnf import GrammarError, safe_grammar
from cli.engine.schema_grammar import FORMATS, SchemaError, schema_to_gbnf


class UnenforcedError(SchemaError):
    """A strict schema with keywords the grammar cannot hold the output to."""

    def __init__(self, keywords: tuple[str, ...]) -> None:
        super().__init__("the grammar cannot enforce " + "; ".join(keywords))
        self.keywords = keywords


# Keywords that only annotate: nothing to enforce.
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment",
                "deprecated", "readOnly", "writeOnly", "$defs", "definitions"}  # fmt: skip
# Keywords the grammar holds the output to.
_ENFORCED = {"type", "properties", "required", "additionalProperties", "items", "prefixItems",
             "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "minLength", "maxLength",
             "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern",
             "format"}  # fmt: skip
# Keywords the grammar holds only in part, as it says.
_HELD_OTHERWISE = {"oneOf": "oneOf (held as anyOf: exactly-one is not enforced)",
                   "allOf": "allOf (only its properties are merged)"}  # fmt: skip
# JSON nesting a schema may have (objects and lists, each a level).
MAX_DEPTH = 128
# Optional properties of one object: after each comma, llama.cpp's grammar keeps a parse stack
# for every optional property that may still follow, through every token.
MAX_OPTIONAL_PROPERTIES = 200


@dataclass(frozen=True)
class Constraint:
    """What the sampler holds the output to, and how the finished text is checked."""

    kind: str  # "schema", "json" (any JSON object) or "grammar" (a GBNF file)
    grammar: str  # GBNF, root rule "root"
    schema: dict[str, Any] | None = None  # the JSON Schema the text must satisfy
    unenforced: tuple[str, ...] = ()  # "where: keyword" the grammar cannot hold the output to
    grammar_file: str | None = None

    def describe_for_prompt(self) -> str:
        """What the system prompt tells the model (models do better when they see the schema)."""
        if self.kind == "schema":
            schema = json.dumps(self.schema, ensure_ascii=False)
            return f"Reply with only a JSON value that matches this JSON Schema: {schema}"
        if self.kind == "json":
            return "Reply with only a JSON object."
        return ""

    @property
    def what(self) -> str:
        return "the grammar" if self.kind == "grammar" else "the JSON"

    def problem(self, text: str, finish_reason: str | None) -> str | None:
        """Why the finished text does not hold (None when it does)."""
        if finish_reason == "length":
            return f"the output reached the token limit before {self.what} was complete"
        if finish_reason not in ("stop", None):
            return f"generation ended early ({finish_reason}) before the output was complete"
        if self.kind == "grammar":
            return None
        try:
            value = json.loads(text)
        except ValueError as error:
            return f"the output is not valid JSON ({error})"
        if self.kind == "json":
            return None if isinstance(value, dict) else "the output is JSON but not an object"
        return schema_violation(self.schema or {}, value)


def schema_violation(schema: dict[str, Any], value: Any) -> str | None:
    """The first way value breaks schema (formats checked too), or None."""
    import jsonschema

    validator_class = _validator_class(schema)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the top level"
    return f"the output does not match the schema at {where}: {error.message}"


def _validator_class(schema: dict[str, Any]) -> Any:
    """The draft a schema is read under: the one its $schema names, else 2020-12, or draft 7
    where an "items" is an array (the tuple form drafts 4 to 7 wrote, which 2020-12 spells
    prefixItems and llama-server still takes)."""
    import jsonschema

    default = (
        jsonschema.Draft7Validator if _tuple_items(schema) else jsonschema.Draft202012Validator
    )
    return jsonschema.validators.validator_for(schema, default)


def _tuple_items(schema: Any) -> bool:
    if isinstance(schema, list):
        return any(_tuple_items(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    return isinstance(schema.get("items"), list) or any(map(_tuple_items, schema.values()))


def check_schema(schema: dict[str, Any]) -> None:
    """Refuse a schema that is not a valid JSON Schema, with jsonschema's reason."""
    import jsonschema

    _refuse_deep(schema)
    validator_class = _validator_class(schema)
    try:
        validator_class.check_schema(schema)
    except jsonschema.exceptions.SchemaError as error:
        raise SchemaError(f"the schema is not a valid JSON Schema: {error.message}") from None
    except (OverflowError, RecursionError, re.error) as error:
        # A pattern Python's re cannot compile ({10^12}: "the repetition number is too large").
        raise SchemaError(f"the schema is not a valid JSON Schema: {error}") from None


def schema_constraint(schema: dict[str, Any], strict: bool = False) -> Constraint:
    """The grammar for a JSON Schema and the keywords it cannot enforce; UnenforcedError for
    those when strict, SchemaError for a schema that cannot become a grammar."""
    _refuse_deep(schema)
    unenforced: list[str] = []
    try:
        grammar = safe_grammar(schema_to_gbnf(schema, unenforced))
    except GrammarError as error:
        raise SchemaError(f"the schema's grammar is refused: {error}") from None
    found = tuple(dict.fromkeys(unenforced + unenforced_keywords(schema)))
    if strict and found:
        raise UnenforcedError(found)
    return Constraint("schema", grammar, schema, found)


def json_object_constraint() -> Constraint:
    return Constraint("json", safe_grammar(schema_to_gbnf({"type": "object"}, [])))


def grammar_constraint(text: str, path: Path | None = None) -> Constraint:
    """A GBNF grammar of the user's own, checked and written as quill hands it to llama.cpp."""
    return Constraint("grammar", safe_grammar(text), grammar_file=str(path) if path else None)


def unenforced_keywords(schema: Any, where: str = "#") -> list[str]:
    """'where: keyword' for each keyword of schema the grammar does not hold the output to."""
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key == "format" and value not in FORMATS:
            found.append(f"{where}: format {value!r}")
        elif key in _HELD_OTHERWISE or key not in _ENFORCED:
            found.append(f"{where}: {_HELD_OTHERWISE.get(key, key)}")
        elif key == "additionalProperties" and isinstance(value, dict):
            found.extend(unenforced_keywords(value, f"{where}/additionalProperties"))
    for container in ("properties", "$defs", "definitions"):
        for name, sub in (schema.get(container) or {}).items():
            found.extend(unenforced_keywords(sub, f"{where}/{container}/{name}"))
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for index, sub in enumerate(schema.get(key) or []):
            found.extend(unenforced_keywords(sub, f"{where}/{key}/{index}"))
    items = schema.get("items")
    if isinstance(items, dict):
        found.extend(unenforced_keywords(items, f"{where}/items"))
    for index, sub in enumerate(items if isinstance(items, list) else []):  # draft 7's tuple
        found.extend(unenforced_keywords(sub, f"{where}/items/{index}"))
    return found


def _refuse_deep(schema: Any) -> None:
    """Every step here (jsonschema, the converter, llama.cpp's grammar parser) recurses: a
    schema nested deeper than any real one is refused before it reaches them."""
    stack = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise SchemaError(f"the schema nests deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            properties = node.get("properties")
            if isinstance(properties, dict) and len(properties) > MAX_OPTIONAL_PROPERTIES:
                required = node.get("required")
                if not isinstance(required, list):
                    required = []
                optional = len(set(properties) - set(required))
                if optional > MAX_OPTIONAL_PROPERTIES:
                    raise SchemaError(
                        f"an object with {optional} optional properties makes llama.cpp's "
                        f"grammar track each at every comma: at most {MAX_OPTIONAL_PROPERTIES} "
                        "(mark some required)"
                    )
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)

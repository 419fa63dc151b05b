"""Structured output: a schema (JSON Schema, llm's concise form, any JSON object, or a raw GBNF
grammar) becomes a Constraint: the GBNF grammar the sampler holds the model to, the keywords
that grammar cannot enforce (named, so that --strict can refuse them), and the check of the
finished text against the schema with the jsonschema package.

The schema-to-grammar converter is llama-cpp-python's (llama_cpp.llama_grammar, a port of
llama.cpp's json-schema-to-grammar.py), subclassed where it falls short: integer and number
ranges, calendar-correct dates, regex classes in patterns, control characters in strings, type
unions that keep their keywords. Importing this module loads neither llama.cpp nor numpy: the
converter is imported when a schema is compiled.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.errors import UsageError


class SchemaError(UsageError):
    """A schema (or grammar) quill cannot read or cannot turn into a grammar."""


# Concise form (llm's): 'name, age int, bio: one sentence'.
CONCISE_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}

# Keywords that only annotate: nothing to enforce.
_ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$defs",
    "definitions",
}
# Keywords the grammar below holds the output to.
_ENFORCED = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "$ref",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "pattern",
    "format",
}
ENFORCED_FORMATS = {"date", "time", "date-time", "uuid"}
_RANGE_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# JSON nesting a schema may have (objects and lists, each a level).
MAX_DEPTH = 128
# Optional properties of one object: the converter writes every order they may come in as a
# chain of rules, which takes seconds past a few hundred (900: 7 s), on a server's request path.
MAX_OPTIONAL_PROPERTIES = 200
# Most digits the grammar lets an unbounded integer have (llama.cpp's own limit is 16).
_MAX_DIGITS = 15


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

    def problem(self, text: str, finish_reason: str | None) -> str | None:
        """Why the finished text does not hold (None when it does)."""
        if finish_reason == "length":
            where = "the grammar" if self.kind == "grammar" else "the JSON"
            return f"the output was cut by --max-tokens before {where} was complete"
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

    validator_class = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the top level"
    return f"the output does not match the schema at {where}: {error.message}"


# --- reading what the user typed ---------------------------------------------------------------


def read_schema(spec: str, multi: bool = False) -> dict[str, Any]:
    """A JSON Schema from --schema's forms: inline JSON, @file.json, or the concise form;
    --schema-multi wraps it as {"items": [...]}, as llm does."""
    text = spec.strip()
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as error:
            raise SchemaError(f"cannot read the schema file {path}: {error}") from None
        if not text.startswith("{"):
            raise SchemaError(f"the schema file {path} does not hold a JSON object")
    if text.startswith("{"):
        try:
            schema = json.loads(text)
        except RecursionError:
            raise SchemaError(f"the schema nests deeper than {MAX_DEPTH} levels") from None
        except ValueError as error:
            raise SchemaError(f"the schema is not valid JSON: {error}") from None
    else:
        schema = concise_schema(text)
    if not isinstance(schema, dict):
        raise SchemaError("a JSON Schema is a JSON object")
    check_schema(schema)
    return multi_schema(schema) if multi else schema


def concise_schema(spec: str) -> dict[str, Any]:
    """llm's concise syntax: fields split by commas (or newlines when there are any), each
    'name [type][: description]' with type str (default), int, float or bool."""
    separator = "\n" if "\n" in spec else ","
    properties: dict[str, Any] = {}
    for raw in spec.split(separator):
        entry = raw.strip()
        if not entry:
            continue
        head, _, description = entry.partition(":")
        words = head.split()
        if not words or len(words) > 2:
            raise SchemaError(
                f"cannot read the field {entry!r}: write 'name', 'name type' or "
                "'name type: description' (types: str, int, float, bool)"
            )
        name = words[0]
        kind = words[1] if len(words) == 2 else "str"
        if kind not in CONCISE_TYPES:
            raise SchemaError(
                f"unknown type {kind!r} for the field {name!r}: use str, int, float or bool"
            )
        prop: dict[str, Any] = {"type": CONCISE_TYPES[kind]}
        if description.strip():
            prop["description"] = description.strip()
        if name in properties:
            raise SchemaError(f"the field {name!r} is given twice")
        properties[name] = prop
    if not properties:
        raise SchemaError("the schema names no fields")
    return {"type": "object", "properties": properties, "required": list(properties)}


def multi_schema(schema: dict[str, Any]) -> dict[str, Any]:
    wrapped: dict[str, Any] = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": schema}},
        "required": ["items"],
    }
    # $refs inside the item point at the document root: keep its definitions there.
    for key in ("$defs", "definitions"):
        if key in schema:
            wrapped[key] = schema[key]
    return wrapped


def check_schema(schema: dict[str, Any]) -> None:
    """Refuse a schema that is not a valid JSON Schema, with jsonschema's reason."""
    import jsonschema

    _refuse_deep(schema)

    validator_class = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
    try:
        validator_class.check_schema(schema)
    except jsonschema.exceptions.SchemaError as error:
        raise SchemaError(f"the schema is not a valid JSON Schema: {error.message}") from None
    except (OverflowError, RecursionError, re.error) as error:
        # A pattern Python's re cannot compile ({10^12}: "the repetition number is too large").
        raise SchemaError(f"the schema is not a valid JSON Schema: {error}") from None


# --- constraints ------------------------------------------------------------------------------


def schema_constraint(schema: dict[str, Any]) -> Constraint:
    """The grammar for a JSON Schema, and the keywords it cannot enforce."""
    _refuse_deep(schema)
    unenforced: list[str] = []
    grammar = schema_to_gbnf(schema, unenforced)
    unenforced.extend(unenforced_keywords(schema))
    return Constraint("schema", grammar, schema, tuple(dict.fromkeys(unenforced)))


def json_object_constraint() -> Constraint:
    return Constraint("json", schema_to_gbnf({"type": "object"}, []))


def grammar_constraint(text: str, path: Path | None = None) -> Constraint:
    """A GBNF grammar of the user's own, checked and written as quill hands it to llama.cpp."""
    from cli.engine.gbnf import safe_grammar

    return Constraint(
        "grammar", safe_grammar(text), grammar_file=str(path) if path is not None else None
    )


def grammar_file_constraint(path: Path) -> Constraint:
    from cli.engine.gbnf import MAX_GRAMMAR_CHARS

    try:
        if path.stat().st_size > 4 * MAX_GRAMMAR_CHARS:  # read no more than the budget allows
            raise SchemaError(
                f"the grammar file {path} is over {MAX_GRAMMAR_CHARS} characters (quill's budget)"
            )
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise SchemaError(f"cannot read the grammar file {path}: {error}") from None
    if not re.search(r"^\s*root\s*::=", text, re.MULTILINE):
        raise SchemaError(f"the grammar file {path} has no 'root ::= ...' rule")
    return grammar_constraint(text, path)


def constraint_from_options(
    schema: str | None, schema_multi: bool, json_format: str | None, grammar: Path | None
) -> Constraint | None:
    """The constraint run and chat were asked for (at most one of the three ways)."""
    given = [name for name, v in (("--schema", schema), ("--format", json_format),
                                  ("--grammar", grammar)) if v]  # fmt: skip
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} both constrain the output: give one")
    if schema_multi and not schema:
        raise UsageError("--schema-multi wraps a --schema: give one")
    if schema:
        return schema_constraint(read_schema(schema, schema_multi))
    if json_format:
        if json_format != "json":
            raise UsageError(f"--format takes json, not {json_format!r}")
        return json_object_constraint()
    if grammar:
        return grammar_file_constraint(grammar)
    return None


def refuse_unenforced(constraint: Constraint) -> None:
    """--strict: a schema whose every keyword the grammar holds, or a usage error."""
    if constraint.unenforced:
        raise SchemaError(
            "--strict: the grammar cannot enforce "
            + "; ".join(constraint.unenforced)
            + " (drop those keywords, or leave out --strict to have the output checked after)"
        )


def unenforced_keywords(schema: Any, where: str = "#") -> list[str]:
    """'where: keyword' for each keyword of schema the grammar does not hold the output to."""
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key == "format" and value not in ENFORCED_FORMATS:
            found.append(f"{where}: format {value!r}")
        elif key == "oneOf":
            found.append(f"{where}: oneOf (held as anyOf: exactly-one is not enforced)")
        elif key == "allOf":
            found.append(f"{where}: allOf (only its properties are merged)")
        elif key not in _ENFORCED:
            found.append(f"{where}: {key}")
        elif key == "additionalProperties" and isinstance(value, dict):
            found.extend(unenforced_keywords(value, f"{where}/additionalProperties"))
    for container in ("properties", "$defs", "definitions"):
        for name, sub in (schema.get(container) or {}).items():
            found.extend(unenforced_keywords(sub, f"{where}/{container}/{name}"))
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for index, sub in enumerate(schema.get(key) or []):
            found.extend(unenforced_keywords(sub, f"{where}/{key}/{index}"))
    if isinstance(schema.get("items"), dict):
        found.extend(unenforced_keywords(schema["items"], f"{where}/items"))
    return found


# --- the grammar -------------------------------------------------------------------------------


def schema_to_gbnf(schema: dict[str, Any], unenforced: list[str]) -> str:
    """GBNF for schema; keywords given up on (a pattern the converter cannot read) are added
    to unenforced. The grammar is checked and written as quill hands it to llama.cpp
    (cli/engine/gbnf.py): within the budget, large bounds counted compactly."""
    from cli.engine.gbnf import GrammarBudgetError, safe_grammar

    converter = _converter_class()(unenforced)
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "input")
        converter.visit(resolved, "")
    except SchemaError:
        raise
    except (
        AssertionError,
        ValueError,
        KeyError,
        TypeError,
        RecursionError,
        OverflowError,
    ) as error:
        raise SchemaError(f"cannot turn the schema into a grammar: {error}") from None
    try:
        return safe_grammar(converter.format_grammar())
    except GrammarBudgetError as error:
        raise SchemaError(f"the schema's grammar is refused: {error}") from None


def _bounds(low: int, high: int | None) -> str:
    """GBNF's own repetition operator for low to high copies (None: no upper bound)."""
    if (low, high) == (0, None):
        return "*"
    if (low, high) == (1, None):
        return "+"
    if (low, high) == (0, 1):
        return "?"
    if high is None:
        return f"{{{low},}}"
    if low == high:
        return f"{{{low}}}"
    return f"{{{low},{high}}}"


def _repetition(
    item_rule: str,
    min_items: int,
    max_items: int | None,
    separator_rule: str | None = None,
    item_rule_is_literal: bool = False,
) -> str:
    """What the upstream converter's _build_repetition means, in GBNF's x{m,n} instead of m
    copies of x and n - m nested optional groups: upstream writes maxLength 30000 as 30000
    nested groups (llama.cpp's parser recurses through them: SIGSEGV) and minLength 10^9 as a
    string of 10^9 copies (memory runs out before any grammar exists). quill's gbnf.py then
    writes a large bound as a few rules that count it."""
    if max_items is not None and max_items < min_items:
        raise SchemaError(f"a repetition of {min_items} to {max_items} items can match nothing")
    if max_items == 0:
        return '""'
    if not separator_rule:
        return f"({item_rule}){_bounds(min_items, max_items)}"
    rest = _bounds(max(min_items - 1, 0), None if max_items is None else max_items - 1)
    both = f"({item_rule} ({separator_rule} {item_rule}){rest})"
    return both if min_items > 0 else both + "?"


# A calendar-correct date: jsonschema's date format rejects 2024-02-31, and year 0000.
_DATE = (
    '[1-9] [0-9] [0-9] [0-9] "-" ( ("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])'
    ' | ("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30")'
    ' | "02" "-" ("0" [1-9] | "1" [0-9] | "2" [0-8]) )'
)
# No raw control characters inside strings: JSON forbids them, and the upstream rule allows them.
_CHAR = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
# Regex classes the upstream pattern converter copies through as unknown GBNF escapes.
_CLASS_ESCAPES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " "}


def _converter_class():
    """The upstream converter with quill's fixes (imported here: it is big, and only schemas
    need it)."""
    from llama_cpp import llama_grammar as upstream

    # The upstream converter's methods call this module function; quill's writes the same
    # repetitions in GBNF's own operators (set once: the same meaning, only compact).
    upstream._build_repetition = _repetition
    fixed_rules = {
        id(upstream.PRIMITIVE_RULES["char"]): upstream.BuiltinRule(_CHAR, []),
        id(upstream.STRING_FORMAT_RULES["date"]): upstream.BuiltinRule(_DATE, []),
    }
    fixed_by_name = {"char": fixed_rules[id(upstream.PRIMITIVE_RULES["char"])],
                     "date": fixed_rules[id(upstream.STRING_FORMAT_RULES["date"])]}  # fmt: skip

    class Converter(upstream.SchemaConverter):
        def __init__(self, unenforced: list[str]) -> None:
            super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
            self.unenforced = unenforced

        def resolve_refs(self, schema: dict, url: str):
            """Local refs only; every node walked (upstream skips the siblings of a $ref,
            so a root {"$ref": ..., "$defs": ...} with refs inside its definitions fails)."""
            _refuse_remote_refs(schema)

            def walk(node: Any) -> None:
                if isinstance(node, list):
                    for item in node:
                        walk(item)
                    return
                if not isinstance(node, dict):
                    return
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith("#"):
                    full = url + ref
                    if full not in self._refs:
                        self._refs[full] = _pointer(schema, ref)
                    node["$ref"] = full
                for value in node.values():
                    walk(value)

            walk(schema)
            return schema

        def _resolve_ref(self, ref: str) -> str:
            # Upstream names the rule after the ref's last part as it is: '#' (the whole
            # document, a recursive schema) gives a name GBNF cannot parse.
            tail = ref.split("#", 1)[-1].split("/")[-1]
            name = re.sub(r"[^a-zA-Z0-9-]+", "-", tail).strip("-") or "document"
            if name in upstream.RESERVED_NAMES:
                name = f"ref-{name}"
            if name not in self._rules and ref not in self._refs_being_resolved:
                self._refs_being_resolved.add(ref)
                name = self.visit(self._refs[ref], name)
                self._refs_being_resolved.remove(ref)
            return name

        def _add_primitive(self, name: str, rule):  # type: ignore[override]
            rule = fixed_rules.get(id(rule), rule)
            key = self._add_rule(name, rule.content)
            for dep in rule.deps:
                dep_rule = (
                    fixed_by_name.get(dep)
                    or upstream.PRIMITIVE_RULES.get(dep)
                    or upstream.STRING_FORMAT_RULES.get(dep)
                )
                if dep not in self._rules:
                    self._add_primitive(dep, dep_rule)
            return key

        def visit(self, schema, name):  # type: ignore[override]
            if schema is True:
                schema = {}
            if not isinstance(schema, dict):
                raise SchemaError(f"cannot turn {schema!r} into a grammar: a schema is an object")
            kind = schema.get("type")
            rule_name = name + "-" if name in upstream.RESERVED_NAMES else name or "root"
            combined = any(k in schema for k in ("$ref", "oneOf", "anyOf", "const", "enum"))
            if isinstance(kind, list) and not combined:
                # Upstream makes {"type": t} of each, dropping the other keywords.
                alternatives = [{**schema, "type": t} for t in kind]
                return self._add_rule(rule_name, self._generate_union_rule(name, alternatives))
            if (
                not combined
                and kind in ("integer", "number")
                and any(k in schema for k in _RANGE_KEYS)
            ):
                try:
                    return self._add_rule(rule_name, _range_rule(schema, kind == "integer"))
                except _NoIntegerInside:
                    if kind == "integer":
                        raise SchemaError(f"no integer lies within {schema}") from None
                    # 0.5 to 0.7: no integer part fits; the range is checked after instead.
                    self.unenforced.append(f"the range of {schema}")
                    rest = {k: v for k, v in schema.items() if k not in _RANGE_KEYS}
                    return self.visit(rest, name)
            if not combined and kind in (None, "string") and "pattern" in schema:
                pattern = _regex_for_gbnf(schema["pattern"])
                if pattern is not None:
                    try:
                        return self._visit_pattern(pattern, rule_name)
                    except (AssertionError, ValueError):
                        pass
                self.unenforced.append(f"pattern {schema['pattern']!r} (not expressible)")
                rest = {k: v for k, v in schema.items() if k != "pattern"}
                return self.visit({**rest, "type": "string"}, name)
            return super().visit(schema, name)

    return Converter


class _NoIntegerInside(Exception):
    """The bounds hold no integer (a number range may still hold fractions)."""


def _pointer(schema: dict[str, Any], ref: str) -> Any:
    """What a local $ref ('#', '#/$defs/x') points at in schema, or SchemaError."""
    target: Any = schema
    for part in ref[1:].split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, list) and key.isdigit() and int(key) < len(target):
            target = target[int(key)]
        elif isinstance(target, dict) and key in target:
            target = target[key]
        else:
            raise SchemaError(f"$ref {ref!r} points at nothing in the schema")
    return target


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
                required = node.get("required") if isinstance(node.get("required"), list) else []
                optional = len(set(properties) - set(required))
                if optional > MAX_OPTIONAL_PROPERTIES:
                    raise SchemaError(
                        f"an object with {optional} optional properties makes a grammar that "
                        f"grows with their square: at most {MAX_OPTIONAL_PROPERTIES} (mark "
                        "some required)"
                    )
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)


def _refuse_remote_refs(schema: Any) -> None:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise SchemaError(f"$ref {ref!r} points outside the schema: only #/... refs are read")
        for value in schema.values():
            _refuse_remote_refs(value)
    elif isinstance(schema, list):
        for value in schema:
            _refuse_remote_refs(value)


def _regex_for_gbnf(pattern: str) -> str | None:
    """The pattern anchored, with \\d \\w \\s and escaped punctuation spelled as the upstream
    converter reads them; None when it uses what the converter cannot express.

    An unanchored pattern is held as if anchored: a string that matches it whole also contains
    a match, so the output stays valid (JSON Schema patterns search)."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            i += 2
            if nxt in _CLASS_ESCAPES:
                out.append(_CLASS_ESCAPES[nxt] if in_class else f"[{_CLASS_ESCAPES[nxt]}]")
            elif nxt in ".-/ :,@#_=!&%'<>~`;":
                out.append(nxt if in_class else f"[{nxt}]")
            elif nxt in "[](){}|*+?":
                out.append("\\" + nxt)
            else:
                return None  # \D \W \S \b, backreferences, unicode classes
            continue
        if c in "^$" or (c == "(" and body[i + 1 : i + 2] == "?"):
            return None  # anchors mid-pattern, lookarounds, named groups
        if c == '"' and in_class:
            return None
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "^" + "".join(out) + "$"


# --- integer and number ranges ---------------------------------------------------------------


def _range_rule(schema: dict[str, Any], integer: bool) -> str:
    """GBNF for an integer (or a number) within the schema's bounds.

    A number's integer part spans the bounds; a fraction is allowed only on integer parts
    strictly inside them, so -3.5 (integer part -3) never goes under a minimum of -4 and 3.5
    never over a maximum of 4. Non-integer bounds are tightened to integers: a subset, never
    more."""
    low, high = _integer_bounds(schema, integer)
    if low is not None and high is not None and low > high:
        raise _NoIntegerInside
    whole = _int_range_gbnf(low, high)
    if integer:
        return f"({whole}) space"
    inner_low = None if low is None else low + 1
    inner_high = None if high is None else high - 1
    if inner_low is not None and inner_high is not None and inner_low > inner_high:
        return f"({whole}) space"
    inner = _int_range_gbnf(inner_low, inner_high)
    return f'(({whole}) | ({inner}) "." [0-9]{{1,15}}) space'


def _integer_bounds(schema: dict[str, Any], integer: bool) -> tuple[int | None, int | None]:
    low = high = None
    if "minimum" in schema:
        low = math.ceil(schema["minimum"])
    if "exclusiveMinimum" in schema:
        bound = schema["exclusiveMinimum"]
        candidate = math.floor(bound) + 1
        low = candidate if low is None else max(low, candidate)
    if "maximum" in schema:
        high = math.floor(schema["maximum"])
    if "exclusiveMaximum" in schema:
        bound = schema["exclusiveMaximum"]
        candidate = math.ceil(bound) - 1
        high = candidate if high is None else min(high, candidate)
    return low, high


def _int_range_gbnf(low: int | None, high: int | None) -> str:
    """GBNF alternatives for the integers in [low, high] (None: unbounded), JSON-spelled."""
    parts: list[str] = []
    if low is None or low < 0:  # negatives: "-" then the magnitudes
        magnitude_low = 1 if high is None or high >= 0 else -high
        magnitude_high = None if low is None else -low
        if magnitude_high is None or magnitude_low <= magnitude_high:
            parts.append(f'"-" ({_natural_range(magnitude_low, magnitude_high)})')
    if high is None or high >= 0:
        parts.append(_natural_range(max(low or 0, 0), high))
    return " | ".join(f"({p})" for p in parts)


def _natural_range(low: int, high: int | None) -> str:
    """Non-negative integers in [low, high], without leading zeros."""
    alternatives: list[str] = []
    # Unbounded above: the numbers of low's length up to it, then any longer number.
    top = len(str(high)) if high is not None else len(str(low))
    for digits in range(len(str(low)), top + 1):
        start = low if digits == len(str(low)) else 10 ** (digits - 1)
        end = high if high is not None and digits == len(str(high)) else 10**digits - 1
        if start > end:
            continue
        alternatives.append(_same_length_range(str(start), str(end)))
    if high is None:
        longer = len(str(low))
        alternatives.append(f"[1-9] [0-9]{{{longer},{_MAX_DIGITS - 1}}}")
    return " | ".join(alternatives)


def _same_length_range(low: str, high: str) -> str:
    """Digit strings of one length from low to high (both that length)."""
    if not low:
        return '""'
    if low == high:
        return f'"{low}"'
    rest = len(low) - 1
    if low[0] == high[0]:
        return f'"{low[0]}" ({_same_length_range(low[1:], high[1:])})'
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return f"[{low[0]}-{high[0]}]" + (f" [0-9]{{{rest}}}" if rest else "")
    out = [f'"{low[0]}" ({_same_length_range(low[1:], "9" * rest)})']
    if int(high[0]) - int(low[0]) > 1:
        middle = f"[{int(low[0]) + 1}-{int(high[0]) - 1}]"
        out.append(middle + (f" [0-9]{{{rest}}}" if rest else ""))
    out.append(f'"{high[0]}" ({_same_length_range("0" * rest, high[1:])})')
    return " | ".join(f"({o})" for o in out)

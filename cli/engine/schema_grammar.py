"""quill's JSON Schema to GBNF converter: what docs/run.md says the grammar enforces, in the
layout llama.cpp's own converter writes (required properties first, then any of the optional ones
in order; one optional space after each value). What it cannot enforce is named in `unenforced`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from cli.engine.gbnf import char_class, literal, repetition
from cli.errors import UsageError


class SchemaError(UsageError):
    """A schema (or grammar) quill cannot read or cannot turn into a grammar."""


# Most digits the grammar lets an unbounded integer have (llama.cpp's own limit is 16).
_MAX_DIGITS = 15
# What a keyword of the wrong type or size raises on the way (jsonschema refuses most before).
_MALFORMED = (AttributeError, KeyError, OverflowError, RecursionError, TypeError, ValueError)
_RANGE_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# What a JSON string may hold raw: no quote, backslash or control character (JSON forbids them).
_UNSAFE = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)]
_PLAIN = char_class(_UNSAFE, negated=True)
_DATE = (  # calendar-correct: jsonschema's date format rejects 2024-02-31, and year 0000
    '[1-9] [0-9]{3} "-" ( ("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])'
    ' | ("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30")'
    ' | "02" "-" ("0" [1-9] | "1" [0-9] | "2" [0-8]) )'
)
_TIME = (
    '([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ("." [0-9]{3})?'
    ' ("Z" | [+-] ([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9])'
)
_HEX = "[0-9a-fA-F]"
_UUID = ' "-" '.join(f"{_HEX}{{{n}}}" for n in (8, 4, 4, 4, 12))
_NUMBER = f'"-"? integral-part ("." [0-9]{{1,{_MAX_DIGITS + 1}}})? ([eE] [-+]? integral-part)?'
PRIMITIVES = {
    "space": '" "?',
    "char": _PLAIN + r' | "\\" (["\\/bfnrt] | "u" ' + _HEX + "{4})",
    "string": r'"\"" char* "\"" space',
    "integral-part": f"[0-9] | [1-9] [0-9]{{0,{_MAX_DIGITS}}}",
    "integer": '"-"? integral-part space',
    "number": _NUMBER + " space",
    "boolean": '("true" | "false") space',
    "null": '"null" space',
    "value": "object | array | string | number | boolean | null",
    "object": '"{" space (string ":" space value ("," space string ":" space value)*)? "}" space',
    "array": '"[" space (value ("," space value)*)? "]" space',
    "date": _DATE,
    "time": _TIME,
    "date-time": 'date "T" time',
}
FORMATS = {"date", "time", "date-time", "uuid"}
_QUOTED = r'"\"" {} "\"" space'  # a JSON string of what {} matches


def schema_to_gbnf(schema: Any, unenforced: list[str], root: str = "root") -> str:
    """GBNF for schema, its start rule named root, not yet checked (gbnf.safe_grammar does);
    what it cannot enforce is added to unenforced; SchemaError for what cannot be a grammar."""
    converter = _Converter(schema, unenforced)
    converter.rules[root] = ""  # first, and taken
    try:
        converter.rules[root] = converter.body(schema, root)
        converter.primitive("space")  # after nearly every value
    except _MALFORMED as error:
        raise SchemaError(f"cannot turn the schema into a grammar: {error}") from None
    return "\n".join(f"{name} ::= {body}" for name, body in converter.rules.items())


def _json_literal(value: Any) -> str:
    return literal(json.dumps(value, ensure_ascii=False))


class _Converter:
    def __init__(self, document: Any, unenforced: list[str]) -> None:
        self.document = document
        self.unenforced = unenforced
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}  # $ref -> its rule

    def add(self, name: str, body: str) -> str:
        """A rule named after name (made unique), or the rule of that name already with body."""
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", name).strip("-") or "r"
        if base in PRIMITIVES or base == "root":
            base += "-"
        name, count = base, 0
        while name in self.rules and self.rules[name] != body:
            count += 1
            name = f"{base}{count}"
        self.rules[name] = body
        return name

    def primitive(self, name: str) -> str:
        if name not in self.rules:
            self.rules[name] = PRIMITIVES[name]
            for used in re.findall(r"[a-z-]+", re.sub(r'"(\\.|[^"])*"', "", PRIMITIVES[name])):
                if used in PRIMITIVES:
                    self.primitive(used)
        return name

    def visit(self, schema: Any, name: str) -> str:
        """The name of a rule for schema (a primitive's own where the schema is only that)."""
        body = self.body(schema, name)
        return body if body in self.rules else self.add(name, body)

    def body(self, schema: Any, name: str) -> str:
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise SchemaError(f"cannot turn {schema!r} into a grammar: a schema is an object")
        kind = schema.get("type")
        if isinstance(schema.get("$ref"), str):
            return self.ref(schema["$ref"])
        if "anyOf" in schema or "oneOf" in schema:
            options = schema.get("anyOf") or schema.get("oneOf") or []
            return " | ".join(self.visit(s, f"{name}-{i}") for i, s in enumerate(options))
        if "const" in schema:
            return _json_literal(schema["const"])
        if "enum" in schema:
            return " | ".join(_json_literal(v) for v in schema["enum"]) or '"" [^\\x00-\\U0010FFFF]'
        if isinstance(kind, list):  # each type with the schema's other keywords
            return " | ".join(self.visit({**schema, "type": t}, f"{name}-{t}") for t in kind)
        closed = schema.get("additionalProperties", True) is not True
        if kind in (None, "object") and ("properties" in schema or closed):
            properties = list((schema.get("properties") or {}).items())
            required = set(schema.get("required") or ())
            return self.object(properties, required, schema.get("additionalProperties"), name)
        if kind in (None, "object") and "allOf" in schema:
            return self.all_of(schema["allOf"], name)
        if kind in (None, "array") and ("items" in schema or "prefixItems" in schema):
            return self.array(schema, name)
        if kind in ("integer", "number") and any(k in schema for k in _RANGE_KEYS):
            return self.number_range(schema, kind == "integer", name)
        if kind in (None, "string") and "pattern" in schema:
            try:
                return _QUOTED.format(_pattern_gbnf(schema["pattern"]))
            except _Unexpressible:
                self.unenforced.append(f"pattern {schema['pattern']!r} (not expressible)")
                schema = {k: v for k, v in schema.items() if k != "pattern"} | {"type": "string"}
                return self.body(schema, name)
        if kind in (None, "string") and schema.get("format") in FORMATS:
            form = schema["format"]
            return _QUOTED.format(_UUID if form == "uuid" else self.primitive(form))
        if kind == "string" and ("minLength" in schema or "maxLength" in schema):
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            return _QUOTED.format(self.repeat(self.primitive("char"), low, high))
        if kind is None:
            return self.primitive("object" if not schema else "value")
        if kind not in ("string", "number", "integer", "boolean", "null", "object", "array"):
            raise SchemaError(f"cannot turn the schema into a grammar: unknown type {kind!r}")
        return self.primitive(kind)

    def ref(self, ref: str) -> str:
        if not ref.startswith("#"):
            raise SchemaError(f"$ref {ref!r} points outside the schema: only #/... refs are read")
        if ref not in self.refs:
            target = _pointer(self.document, ref)
            tail = ref.rsplit("/", 1)[-1] if "/" in ref else "document"
            self.refs[ref] = name = self.add(tail, f"<{ref}>")  # taken before its body exists
            self.rules[name] = self.body(target, name)
        return self.refs[ref]

    def object(self, properties: list, required: set, additional: Any, name: str) -> str:
        pairs = {
            key: self.add(f"{name}-{key}-kv", f'{_json_literal(key)} space ":" space '
                          + self.visit(sub, f"{name}-{key}"))
            for key, sub in properties
        }  # fmt: skip
        needed = [pairs[key] for key, _ in properties if key in required]
        optional = [pairs[key] for key, _ in properties if key not in required]
        if additional is True or isinstance(additional, dict):
            value = self.visit({} if additional is True else additional, f"{name}-additional")
            pair = self.add(
                f"{name}-additional-kv", f'{self.primitive("string")} ":" space {value}'
            )
            optional.append(self.add(f"{name}-additional-kvs", f'{pair} ("," space {pair})*'))
        body = '"{" space ' + ' "," space '.join(needed)
        if optional:
            # rest[i]: any of the optional pairs from i on, in order, each after a comma.
            rest = [""] * (len(optional) + 1)
            for i in reversed(range(len(optional))):
                rest[i] = self.add(f"{name}-rest", f'("," space {optional[i]})? {rest[i + 1]}')
            if needed:
                body += " " + rest[0]
            else:
                body += (
                    " (" + " | ".join(f"{o} {rest[i + 1]}" for i, o in enumerate(optional)) + ")?"
                )
        return body + ' "}" space'

    def all_of(self, parts: list, name: str) -> str:
        """llama.cpp's reading of allOf: its parts' properties merged (an anyOf's optional)."""
        properties: list = []
        required: set = set()
        for part in parts:
            optional = isinstance(part, dict) and "anyOf" in part
            for sub in part["anyOf"] if optional else [part]:
                if isinstance(sub, dict) and isinstance(sub.get("$ref"), str):
                    sub = _pointer(self.document, sub["$ref"])
                for key, value in (sub.get("properties") or {}).items():
                    properties.append((key, value))
                    required.update(() if optional else (key,))
        return self.object(properties, required, None, name)

    def array(self, schema: dict, name: str) -> str:
        items = schema.get("prefixItems") or schema.get("items")
        if isinstance(items, list):
            tuple_rules = [self.visit(s, f"{name}-{i}") for i, s in enumerate(items)]
            return '"[" space ' + ' "," space '.join(tuple_rules) + ' "]" space'
        item = self.visit(items, f"{name}-item")
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high is not None and high < low:
            raise SchemaError(f"an array of {low} to {high} items can match nothing")
        if high == 0:
            return '"[" space "]" space'
        rest = repetition(max(low - 1, 0), None if high is None else high - 1)
        both = f'({item} ("," space {item}){rest})'
        return f'"[" space {both if low > 0 else both + "?"} "]" space'

    def repeat(self, item: str, low: int, high: int | None) -> str:
        if high is not None and high < low:
            raise SchemaError(f"a string of {low} to {high} characters can match nothing")
        return '""' if high == 0 else f"{item}{repetition(low, high)}"

    def number_range(self, schema: dict, integer: bool, name: str) -> str:
        try:
            return _range_rule(schema, integer) + " space"
        except _NoIntegerInside:
            if integer:
                raise SchemaError(f"no integer lies within {schema}") from None
            # 0.5 to 0.7: no integer part fits; the range is checked after instead.
            self.unenforced.append(f"the range of {schema}")
            return self.body({k: v for k, v in schema.items() if k not in _RANGE_KEYS}, name)


def _pointer(document: Any, ref: str) -> Any:
    """What a local $ref ('#', '#/$defs/x') points at in the document, or SchemaError."""
    target = document
    for part in ref[1:].split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, list) and key.isdigit() and int(key) < len(target):
            target = target[int(key)]
        elif isinstance(target, dict) and key in target:
            target = target[key]
        else:
            raise SchemaError(f"$ref {ref!r} points at nothing in the schema")
    return target


class _Unexpressible(Exception):
    """A pattern a grammar cannot say (lookarounds, \\b, backreferences, inner anchors)."""


_CLASS_ESCAPES = {"d": [(48, 57)], "w": [(48, 57), (65, 90), (95, 95), (97, 122)], "s": [(32, 32)]}
_CHAR_ESCAPES = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "0": 0}


def _pattern_gbnf(pattern: str) -> str:
    """GBNF for the JSON string content of what the pattern matches whole: characters as JSON
    writes them, classes without the characters JSON must escape. An unanchored pattern is held
    as if anchored: a string that matches it whole also contains a match."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    reader = _PatternReader(body)
    text = reader.alternatives()
    if reader.at < len(body):
        raise _Unexpressible
    return text


class _PatternReader:
    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def peek(self, size: int = 1) -> str:
        return self.text[self.at : self.at + size]

    def alternatives(self) -> str:
        options = [self.sequence()]
        while self.peek() == "|":
            self.at += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"

    def sequence(self) -> str:
        items = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.atom() + self.quantifier())
        return " ".join(items) or '""'

    def atom(self) -> str:
        c = self.peek()
        self.at += 1
        if c == "(":
            if self.peek() == "?":
                if self.peek(2) != "?:":
                    raise _Unexpressible  # lookarounds, named groups
                self.at += 2
            inner = self.alternatives()
            if self.peek() != ")":
                raise _Unexpressible
            self.at += 1
            return f"({inner})"
        if c == "[":
            return self.char_set()
        if c == ".":
            return _PLAIN
        if c == "}" or (c == "{" and not re.match(r"(\d+(,\d*)?|,\d*)\}", self.text[self.at :])):
            return literal(c)
        if c in "^$*+?{)":
            raise _Unexpressible
        if c == "\\":
            ranges = self.escape(in_set=False)
            if isinstance(ranges, list):
                return char_class(_safe(ranges), negated=False)
            c = chr(ranges)
        return literal(json.dumps(c, ensure_ascii=False)[1:-1])

    def escape(self, in_set: bool) -> int | list[tuple[int, int]]:
        """After a backslash: a codepoint, or the ranges of a class escape."""
        c = self.peek()
        self.at += 1
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CHAR_ESCAPES and not (c == "0" and self.peek().isdigit()):
            return _CHAR_ESCAPES[c]
        for letter, size in (("x", 2), ("u", 4)):
            digits = self.text[self.at : self.at + size]
            if c == letter and re.fullmatch(f"[0-9a-fA-F]{{{size}}}", digits):
                self.at += size
                return int(digits, 16)
        if (c and not c.isalnum() and c != "_") or (in_set and c == "b"):
            return 8 if c == "b" else ord(c)
        raise _Unexpressible  # \D \W \S \b \B, backreferences, unicode classes

    def char_set(self) -> str:
        negated = self.peek() == "^"
        self.at += negated
        ranges: list[tuple[int, int]] = []
        first = True
        while self.peek() != "]" or first:
            first = False
            low = self.set_char()
            if isinstance(low, list):
                ranges.extend(low)
                continue
            high = low
            if self.peek() == "-" and self.peek(2)[1:] not in ("]", ""):
                self.at += 1
                upper = self.set_char()
                if isinstance(upper, list):
                    raise _Unexpressible
                high = upper
            ranges.append((low, high))
        self.at += 1
        if negated:
            return char_class(ranges + _UNSAFE, negated=True)
        return char_class(_safe(ranges), negated=False)

    def set_char(self) -> int | list[tuple[int, int]]:
        c = self.peek()
        if not c:
            raise _Unexpressible
        self.at += 1
        return self.escape(in_set=True) if c == "\\" else ord(c)

    def quantifier(self) -> str:
        found = re.match(r"[*+?]|\{(\d*)(,(\d*))?\}", self.text[self.at :])
        if not found or found.group(0) == "{}":
            return ""
        self.at += found.end()
        if self.peek() == "?":  # lazy: the same strings
            self.at += 1
        if found.group(0) in "*+?":
            return found.group(0)
        low = int(found.group(1) or 0)
        high = low if found.group(2) is None else (int(found.group(3)) if found.group(3) else None)
        return repetition(low, high)


def _safe(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """ranges without the characters a JSON string cannot hold raw (_Unexpressible if none)."""
    kept = ranges
    for bad_low, bad_high in _UNSAFE:
        kept = [(lo, hi) for low, high in kept
                for lo, hi in ((low, min(high, bad_low - 1)), (max(low, bad_high + 1), high))
                if lo <= hi]  # fmt: skip
    if not kept:
        raise _Unexpressible
    return kept


class _NoIntegerInside(Exception):
    """The bounds hold no integer (a number range may still hold fractions)."""


def _range_rule(schema: dict[str, Any], integer: bool) -> str:
    """GBNF for an integer (or a number) within the schema's bounds, tightened to integers. A
    fraction is allowed only on integer parts strictly inside them: -3.5 never goes under a
    minimum of -4, 3.5 never over a maximum of 4."""
    low, high = _integer_bounds(schema)
    if low is not None and high is not None and low > high:
        raise _NoIntegerInside
    whole = int_range_gbnf(low, high)
    inner_low = None if low is None else low + 1
    inner_high = None if high is None else high - 1
    if integer or (inner_low is not None and inner_high is not None and inner_low > inner_high):
        return f"({whole})"
    inner = int_range_gbnf(inner_low, inner_high)
    return f'(({whole}) | ({inner}) "." [0-9]{{1,15}})'


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    lows = [math.ceil(schema["minimum"])] if "minimum" in schema else []
    if "exclusiveMinimum" in schema:
        lows.append(math.floor(schema["exclusiveMinimum"]) + 1)
    highs = [math.floor(schema["maximum"])] if "maximum" in schema else []
    if "exclusiveMaximum" in schema:
        highs.append(math.ceil(schema["exclusiveMaximum"]) - 1)
    return max(lows, default=None), min(highs, default=None)


def int_range_gbnf(low: int | None, high: int | None) -> str:
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
        if start <= end:
            alternatives.append(_same_length_range(str(start), str(end)))
    if high is None:
        alternatives.append(f"[1-9] [0-9]{{{len(str(low))},{_MAX_DIGITS - 1}}}")
    return " | ".join(alternatives)


def _same_length_range(low: str, high: str) -> str:
    """Digit strings of one length from low to high (both that length)."""
    if low == high:
        return f'"{low}"' if low else '""'
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

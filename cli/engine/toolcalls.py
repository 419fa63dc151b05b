"""Tool calls in a model's reply: the formats the families write, parsed into OpenAI tool_calls,
and a GBNF grammar that forces a call (tool_choice "required" or a named function).

Formats:
- Hermes / Qwen (ChatML family): <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one
  block per call;
- Llama 3.x: the reply is one JSON object {"name": ..., "parameters": {...}} (after the
  <|python_tag|> control token, which never reaches the text);
- Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or [TOOL_CALLS]name[ARGS]{...}
  (v7 and later); where [TOOL_CALLS] is a control token only the JSON array reaches the text;
- generic fallback: a reply that is a JSON object with name and arguments (or parameters), or an
  array of them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cli.engine.reasoning import partial_suffix
from cli.units import shortened

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call = {"index": index, **call}
        return call


def call_format(family: str) -> str:
    """The tool call format a template family writes."""
    if family.startswith("mistral"):
        return "mistral"
    return {"llama3": "llama3", "chatml": "hermes"}.get(family, "json")


def _call(name: Any, arguments: Any) -> ToolCall | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        text = arguments
    else:
        text = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


def _json_calls(value: Any) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict):
            return None
        arguments = item.get("arguments", item.get("parameters"))
        call = _call(item.get("name"), arguments)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_tool_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """(content left outside the calls, the calls) of a finished reply; no calls where the text
    holds none that parse (an unfinished call stays content)."""
    if fmt == "hermes" or HERMES_OPEN in text:
        calls: list[ToolCall] = []
        blocks = re.findall(
            re.escape(HERMES_OPEN) + r"\s*(.*?)\s*" + re.escape(HERMES_CLOSE), text, re.S
        )
        for block in blocks:
            parsed = _json_calls(_loads(block))
            if parsed is None:
                return text, []
            calls.extend(parsed)
        if calls:
            return text[: text.index(HERMES_OPEN)].strip(), calls
    if MISTRAL_MARK in text:
        before, _, after = text.partition(MISTRAL_MARK)
        if MISTRAL_ARGS in after:  # name[ARGS]{...} (v7 and later), repeated
            calls = []
            for part in after.split(MISTRAL_MARK):
                name, _, arguments = part.partition(MISTRAL_ARGS)
                value = _loads(arguments)
                call = _call(name.strip(), value) if isinstance(value, dict) else None
                if call is None:
                    return text, []
                calls.append(call)
            return before.strip(), calls
        parsed = _json_calls(_loads(after))
        if parsed:
            return before.strip(), parsed
        return text, []
    parsed = _json_calls(_loads(text.strip())) if text.strip()[:1] in ("{", "[") else None
    if parsed:
        return "", parsed
    return text, []


def may_start_call(text: str) -> int:
    """How much of text is surely content: the index where a tool call starts or may start (a
    marker, a partial marker at the end, a reply that opens with JSON); len(text) if none."""
    if text.lstrip()[:1] in ("{", "["):
        return 0
    cut = len(text)
    for mark in (HERMES_OPEN, MISTRAL_MARK):
        at = text.find(mark)
        if at >= 0:
            cut = min(cut, at)
            continue
        cut = min(cut, len(text) - partial_suffix(text, mark))
    return cut


class ToolsError(ValueError):
    """A tools or tool_choice value the server refuses (400), with the reason."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


# OpenAI's ^[a-zA-Z0-9_-]{1,64}$, with the '.' and ':' of namespaced (MCP) tools: a name is
# written into the forcing grammar's literals and the template's text, where a quote, a
# backslash or a newline would change what they mean.
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict] | None, str | None]:
    """The request's tools (None when absent or tool_choice is "none") and the function a call
    must name: "*" for any (required), a name, or None (the model decides). Every name and
    every parameters schema is checked here, whatever tool_choice says."""
    from cli.engine.structured import SchemaError, check_schema

    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise ToolsError("'tool_choice' needs 'tools'", "tool_choice")
        return None, None
    if not isinstance(tools, list):
        raise ToolsError("'tools' must be an array of tool objects", "tools")
    names = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or tool.get("type", "function") != "function"
        ):
            raise ToolsError(
                f'tools[{index}] must be an object with type "function" and a function '
                "object that has a name",
                "tools",
            )
        if not TOOL_NAME.fullmatch(function["name"]):
            raise ToolsError(
                f"tools[{index}].function.name must be 1 to 64 letters, digits, '_', '-', '.' "
                f"or ':' (OpenAI's rule, with '.' and ':'), not "
                + shortened(repr(function["name"])),
                "tools",
            )
        parameters = function.get("parameters", {})
        if not isinstance(parameters, dict):
            raise ToolsError(f"tools[{index}].function.parameters must be an object", "tools")
        try:
            check_schema(parameters)
        except SchemaError as error:
            raise ToolsError(f"tools[{index}].function.parameters: {error}", "tools") from None
        names.append(function["name"])
    if tool_choice in (None, "auto"):
        return tools or None, None
    if tool_choice == "none":
        return None, None
    if tool_choice == "required":
        return tools, "*"
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str) and name in names:
            return tools, name
        shown = shortened(repr(name))
        raise ToolsError(f"tool_choice names {shown}, which is not one of the tools", "tool_choice")
    raise ToolsError(
        '\'tool_choice\' must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def forcing_grammar(tools: Sequence[Mapping[str, Any]], required: str, fmt: str) -> str:
    """GBNF for one call in the family's format to a tool (any, or the one named), its arguments
    following the tool's JSON schema (cli/engine/schema_grammar.py), checked as every grammar is
    (cli/engine/gbnf.py); ToolsError when a tool's schema cannot become a grammar."""
    from cli.engine.gbnf import GrammarError, safe_grammar
    from cli.engine.schema_grammar import SchemaError, schema_to_gbnf

    key = "parameters" if fmt == "llama3" else "arguments"
    choices = []
    for tool in tools:
        function = tool["function"]
        if required not in ("*", function["name"]):
            continue
        choices.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    key: function.get("parameters") or {"type": "object"},
                },
                "required": ["name", key],
            }
        )
    schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
    outer = {"hermes": f'"{HERMES_OPEN}\\n" tc-call "\\n{HERMES_CLOSE}"',
             "mistral": f'"{MISTRAL_MARK}[" tc-call "]"'}.get(fmt, "tc-call")  # fmt: skip
    try:
        return safe_grammar(f"root ::= {outer}\n" + schema_to_gbnf(schema, [], root="tc-call"))
    except (SchemaError, GrammarError) as error:
        raise ToolsError(f"a tool's parameters cannot become a grammar: {error}", "tools") from None

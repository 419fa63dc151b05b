"""OpenAI's Responses API over quill's scheduler: POST /v1/responses, GET and DELETE
/v1/responses/{id}. A request is translated into the chat-completions body parse_request reads,
so templates, tools, structured output, sampling bounds and the context check have one rule for
both routes; ChatReply's deltas (reasoning, text, tool calls) are then shaped as Responses output
items, whole or as its stream events. Finished responses are kept in a ResponseStore, for GET and
for previous_response_id, which continues one: its conversation and output come before the new
input, so the prompt begins with the previous one and the scheduler's prefix cache reuses it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cli.api.replies import ChatReply, progress_json, progress_timings, timings
from cli.api.server import (
    SAMPLING_RANGES,
    ApiError,
    OneChoice,
    ServedRequest,
    ServerLimits,
    bad_request,
    parse_request,
    shown_json,
    text_field,
    typed_field,
)
from cli.engine.events import PromptProgress, StreamEvent
from cli.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from cli.engine.engine import Engine

Item = dict[str, Any]

# Each input item becomes a chat message the template renders: a bound on their number keeps one
# body (a megabyte of tiny items) from tying a worker thread up in the template. The history a
# previous_response_id brings passed the context check when it was made.
MAX_INPUT_ITEMS = 4096
# OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA = (16, 64, 512)
KINDS = ("message", "function_call", "function_call_output", "reasoning")
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
FORMATS = ("text", "json_object", "json_schema")
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


# --- the store ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Stored:
    response: str  # the response object, as JSON: kept as text, no caller can change it
    continuation: str  # the items a response continuing it begins with, as JSON


class ResponseStore:
    """Finished responses by id, in memory: the max_count most recently used, and no more than
    max_bytes of JSON in all (each record repeats its conversation's history, so a count alone
    would not bound the memory). Past either bound the least recently used go first; storing
    a response, GET and continuing one use it. The newest record stays even if it alone is over
    max_bytes: its client is about to continue it. Every request of the server shares one store,
    so one lock guards it."""

    def __init__(self, max_count: int = 256, max_bytes: int = 64 << 20) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, _Stored] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], continuation: list[Item]) -> None:
        """Keep a finished response, and the items a response continuing it begins with."""
        record = _Stored(json.dumps(response), json.dumps(continuation))
        with self._lock:
            self._drop(response["id"])
            self._records[response["id"]] = record
            self._bytes += _size(record)
            while len(self._records) > 1 and (
                len(self._records) > self.max_count or self._bytes > self.max_bytes
            ):
                self._drop(next(iter(self._records)))

    def retrieve(self, ident: str) -> dict[str, Any] | None:
        """The response object (None: unknown, evicted, deleted, or sent with store false)."""
        record = self._used(ident)
        return json.loads(record.response) if record is not None else None

    def continuation(self, ident: str) -> list[Item] | None:
        """The items a response continuing ident begins with: its input items (those of the
        responses it continued first), then its output."""
        record = self._used(ident)
        return json.loads(record.continuation) if record is not None else None

    def delete(self, ident: str) -> bool:
        with self._lock:
            return self._drop(ident)

    def __len__(self) -> int:
        return len(self._records)

    def _used(self, ident: str) -> _Stored | None:
        with self._lock:
            record = self._records.get(ident)
            if record is not None:
                self._records.move_to_end(ident)
            return record

    def _drop(self, ident: str) -> bool:
        record = self._records.pop(ident, None)
        if record is not None:
            self._bytes -= _size(record)
        return record is not None


def _size(record: _Stored) -> int:
    return len(record.response) + len(record.continuation)


# --- the request ----------------------------------------------------------------------------------


@dataclass
class ResponsesRequest(ServedRequest):
    """A request for the scheduler, with what its response echoes and what its store keeps."""

    conversation: list[Item] = field(default_factory=list)  # input items, the history first
    echo: dict[str, Any] = field(default_factory=dict)  # the request's settings, as echoed
    store: bool = True
    timings_per_token: bool = False  # llama-server's: timings on each delta, as on /completion


class ResponsesApi(OneChoice):
    """POST /v1/responses, whose finished responses go into store (the one that serves GET
    and DELETE /v1/responses/{id})."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def parse(self, body: dict, engine: Engine, limits: ServerLimits) -> ResponsesRequest:
        history = self._history(body.get("previous_response_id"))
        conversation = history + _input_items(body.get("input"))
        messages = _messages(conversation)
        instructions = _optional_text(body, "instructions")
        if instructions is not None:  # this request's only: a continuation does not inherit it
            messages.insert(0, {"role": "system", "content": instructions})
        if not messages:
            raise bad_request("'input' is empty: send a string or at least one item", "input")
        served = _parsed(_chat_body(body, messages), engine, limits)
        fields = {f.name: getattr(served, f.name) for f in dataclasses.fields(ServedRequest)}
        return ResponsesRequest(
            **fields,
            conversation=conversation,
            echo=echoed_settings(body, instructions),
            store=typed_field(body, "store", bool, True),
            timings_per_token=typed_field(body, "timings_per_token", bool, False),
        )

    def reply_format(self, body: dict, served: ServedRequest, model_name: str) -> ResponseWriter:
        assert isinstance(served, ResponsesRequest) and served.reply is not None  # from parse
        return ResponseWriter(self.store, served, model_name)

    def _history(self, ident: Any) -> list[Item]:
        if ident is None:
            return []
        if not isinstance(ident, str):
            raise bad_request("'previous_response_id' must be a string", "previous_response_id")
        items = self.store.continuation(ident)
        if items is None:
            raise bad_request(
                f"Previous response with id {ident!r} not found (unknown, evicted, deleted, or "
                "sent with store false)",
                "previous_response_id",
                "previous_response_not_found",
            )
        return items


def _input_items(given: Any) -> list[Item]:
    """input, a string or an array of items, as items in one shape (see _item)."""
    if isinstance(given, str):
        return [
            {"type": "message", "role": "user", "content": text_field(given, "'input'", "input")}
        ]
    if not isinstance(given, list):
        raise bad_request(
            f"'input' must be a string or an array of input items, got {_kind(given)}", "input"
        )
    if len(given) > MAX_INPUT_ITEMS:
        raise bad_request(
            f"'input' has {len(given)} items; this server takes at most {MAX_INPUT_ITEMS}", "input"
        )
    return [_item(item, f"input[{index}]") for index, item in enumerate(given)]


def _item(item: Any, where: str) -> Item:
    """An input item (or an output item sent back) checked, in the one shape the store keeps:
    a message's content as text, a function call's output as text, a reasoning item's text."""
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object, got {_kind(item)}", "input")
    kind = item.get("type", "message")  # an easy input message has no type
    if kind not in KINDS:
        raise bad_request(
            f"{where} has type {shown_json(kind)}; this server takes {', '.join(KINDS)} items",
            "input",
        )
    if kind == "message":
        if item.get("role") not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}", "input")
        content = _text(item.get("content"), f"{where}.content")
        return {"type": kind, "role": item["role"], "content": content}
    if kind == "reasoning":  # its text, for templates that show the reasoning of a tool turn
        text = _text(item.get("content") or [], f"{where}.content", ("reasoning_text",))
        return {"type": kind, "content": text}
    call = {"type": kind, "call_id": _string(item, "call_id", where)}
    if kind == "function_call":
        name, arguments = _string(item, "name", where), _string(item, "arguments", where)
        return {**call, "name": name, "arguments": arguments}
    return {**call, "output": _text(item.get("output"), f"{where}.output")}


def _text(content: Any, where: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """Content as text: a string, or an array of text parts, joined. Images, audio and files
    are refused: this server reads text only, and an answer that ignored them would mislead."""
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in kinds:
                raise bad_request(
                    f"{where}[{index}] must be a part of type {' or '.join(kinds)}, got "
                    f"{shown_json(kind if kind is not None else part)}; this server reads text "
                    "only",
                    "input",
                )
            texts.append(_string(part, "text", f"{where}[{index}]"))
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{where} must be a string or an array of text parts", "input")
    return text_field(content, where, "input")


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{name} must be a string, got {_kind(value)}", "input")
    return text_field(value, f"{where}.{name}", "input")


def _messages(items: list[Item]) -> list[dict[str, Any]]:
    """Items as chat messages: a reasoning item, an assistant message and the function calls
    after them are one assistant turn (as the model wrote them); a function call's output is
    a tool message, refused when no function call before it has its call_id."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> the function's name, of every call so far
    for item in items:
        kind = item["type"]
        if kind == "function_call_output":
            if item["call_id"] not in names:
                raise bad_request(
                    f"function_call_output for call_id {shown_json(item['call_id'])}, which no "
                    "function_call before it has",
                    "input",
                )
            name = names[item["call_id"]]
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "name": name,
                             "content": item["output"]})  # fmt: skip
        elif kind == "message" and item["role"] != "assistant":
            messages.append({"role": item["role"], "content": item["content"]})
        else:
            _add_to_turn(messages, item)
            if kind == "function_call":
                names[item["call_id"]] = item["name"]
    return messages


def _add_to_turn(messages: list[dict[str, Any]], item: Item) -> None:
    """An assistant message, function call or reasoning item, into the assistant turn it is
    part of (the last message, if that is an assistant turn it can still follow in)."""
    turn = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    kind = item["type"]
    follows = turn is not None and (
        kind == "function_call"
        or (kind == "message" and not turn["content"] and "tool_calls" not in turn)
        or (kind == "reasoning" and not turn["content"] and "tool_calls" not in turn)
    )
    if turn is None or not follows:
        turn = {"role": "assistant", "content": ""}
        messages.append(turn)
    if kind == "reasoning":
        turn["reasoning_content"] = turn.get("reasoning_content", "") + item["content"]
    elif kind == "message":
        turn["content"] = item["content"]
    else:
        call = {"name": item["name"], "arguments": item["arguments"]}
        turn.setdefault("tool_calls", []).append(
            {"id": item["call_id"], "type": "function", "function": call}
        )


def _chat_body(body: dict, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions body parse_request reads for this request."""
    _check_settings(body)
    chat: dict[str, Any] = {"messages": messages, "stream": body.get("stream")}
    chat["return_progress"] = body.get("return_progress")  # llama-server's
    chat["max_tokens"] = body.get("max_output_tokens")
    # the sampling fields: temperature and top_p are the Responses API's, the rest
    # llama-server's extensions (seed, top_k, ...), read as on /v1/chat/completions
    chat.update({name: body[name] for name in SAMPLING_RANGES if name in body})
    tools = _chat_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    choice = _chat_tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    thinking = _thinking(body.get("reasoning"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    return chat


def _thinking(reasoning: Any) -> bool | None:
    """reasoning.effort as the template's thinking switch: "none" turns it off, any other
    effort on (a template has no degrees of it); None: the server's default."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad_request(f"'reasoning' must be an object, got {_kind(reasoning)}", "reasoning")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise bad_request(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}", "reasoning")
    return effort != "none"


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' function tools ({"type": "function", "name", ...}) in chat's shape. Any other
    type is a tool the server would run (web search, file search, code interpreter) or route
    (a namespace of an agent's sub-tools): quill runs none, so the model is not offered them.
    Agents send them on every request (Codex CLI: web_search and a namespace), so they are
    left out, not refused."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request(
            f"'tools' must be an array of function tools, got {_kind(tools)}", "tools"
        )
    chat = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise bad_request(f"tools[{index}] must be an object with a type", "tools")
        if tool["type"] != "function":
            continue
        kept = ("name", "description", "parameters", "strict")
        chat.append({"type": "function", "function": {k: tool[k] for k in kept if k in tool}})
    return chat or None


def _chat_tool_choice(choice: Any) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(
        '\'tool_choice\' must be "auto", "none", "required" or {"type": "function", "name": '
        f"...}}, got {shown_json(choice)}",
        "tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    """text.format as chat's response_format: text, json_object, or json_schema (name, schema,
    strict at the format's top level here, inside json_schema there)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request(f"'text' must be an object, got {_kind(text)}", "text")
    given = text.get("format")
    if given is None:
        return None
    if not isinstance(given, dict) or given.get("type") not in FORMATS:
        raise bad_request(
            "'text.format' must be an object of type text, json_object or json_schema",
            "text.format",
        )
    if given["type"] != "json_schema":
        return {"type": given["type"]}
    if not isinstance(given.get("schema"), dict):
        raise bad_request(
            "'text.format' of type json_schema needs a 'schema' object", "text.format"
        )
    spec = {key: given[key] for key in ("name", "schema", "strict") if key in given}
    return {"type": "json_schema", "json_schema": spec}


def _check_settings(body: dict) -> None:
    """The fields the response only echoes, checked: a wrong type is refused, not echoed."""
    typed_field(body, "store", bool, True)
    typed_field(body, "parallel_tool_calls", bool, True)
    _optional_text(body, "user")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise bad_request("'truncation' must be auto or disabled", "truncation")
    if typed_field(body, "background", bool, False):
        raise bad_request("background responses are not supported: send the request and wait, "
                          "or stream it", "background")  # fmt: skip
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad_request(
            f"'metadata' must be an object, got {_kind(body['metadata'])}", "metadata"
        )
    pairs, key_chars, value_chars = MAX_METADATA
    metadata = body.get("metadata") or {}
    if len(metadata) > pairs or not all(
        len(key) <= key_chars and isinstance(value, str) and len(value) <= value_chars
        for key, value in metadata.items()
    ):
        raise bad_request(
            f"'metadata' takes at most {pairs} pairs of a key of at most {key_chars} characters "
            f"and a string value of at most {value_chars}",
            "metadata",
        )


def _optional_text(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, got {_kind(value)}", name)
    return text_field(value, f"'{name}'", name)


# parse_request's names for what the Responses API names otherwise: its refusals are said again
# with this API's names (a param, and a field quoted in the message).
RENAMED_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
                  "response_format": "text.format"}  # fmt: skip
RENAMED_WORDS = [
    (re.compile(r"'messages'"), "'input'"),
    (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"(tools\[\d+\])\.function\."), r"\1."),
]


def _parsed(chat: dict[str, Any], engine: Engine, limits: ServerLimits) -> ServedRequest:
    try:
        return parse_request(chat, engine, limits, chat=True)
    except ApiError as error:
        for pattern, name in RENAMED_WORDS:
            error.message = pattern.sub(name, error.message)
        error.param = RENAMED_PARAMS.get(error.param or "", error.param)
        error.args = (error.message,)
        raise


def echoed_settings(body: dict, instructions: str | None) -> dict[str, Any]:
    """The request's settings as the response object shows them (OpenAI's defaults where
    absent; the sampling ones the server's)."""
    defaults = SamplingParams()
    return {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": typed_field(body, "parallel_tool_calls", bool, True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning"),
        "store": typed_field(body, "store", bool, True),
        "temperature": typed_field(body, "temperature", float, defaults.temperature),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": typed_field(body, "top_p", float, defaults.top_p),
        "truncation": body.get("truncation") or "disabled",
        "user": body.get("user"),
    }


def _kind(value: Any) -> str:
    """What a value is, in JSON's words, for a refusal."""
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "an array", dict: "an object", type(None): "null"}  # fmt: skip
    return names.get(type(value), type(value).__name__)


# --- the reply ------------------------------------------------------------------------------------


def _ident(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items, built from ChatReply's deltas, and each change as the stream
    events that tell it: a reasoning item, then a message, then function calls, as the model
    writes them (each delta kind opens its item and closes the one before)."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.open: Item | None = None  # the reasoning or message item being written

    def add(self, delta: dict[str, Any]) -> list[Item]:
        told: list[Item] = []
        if delta.get("reasoning_content"):
            told += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            told += self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            told += self._call(call["id"], call["function"]["name"], call["function"]["arguments"])
        return told

    def finish(self, status: str) -> list[Item]:
        """The events that close the output; a reply that wrote nothing still has its (empty)
        message, where clients look for the answer."""
        told = self._close(status)
        if not self.items:
            told += self._open("message") + self._close(status)
        return told

    def _text(self, kind: str, text: str) -> list[Item]:
        told = []
        if self.open is None or self.open["type"] != kind:
            told = self._close("completed") + self._open(kind)
        assert self.open is not None
        self.open["content"][0]["text"] += text
        event = {**self._where(), "content_index": 0, "delta": text}
        if kind == "message":
            return [*told, {"type": "response.output_text.delta", **event, "logprobs": []}]
        return [*told, {"type": "response.reasoning_text.delta", **event}]

    def _open(self, kind: str) -> list[Item]:
        item: Item = {"type": kind, "id": _ident("rs" if kind == "reasoning" else "msg")}
        if kind == "message":
            item.update(role="assistant", status="in_progress", content=[])
            part: Item = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item.update(summary=[], content=[], status="in_progress")
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.open = item
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}  # fmt: skip
        item["content"].append(part)
        part_added = {"type": "response.content_part.added", **self._where(), "content_index": 0,
                      "part": copy.deepcopy(part)}  # fmt: skip
        return [added, part_added]

    def _close(self, status: str) -> list[Item]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {**self._where(item), "content_index": 0}
        part = item["content"][0]
        if item["type"] == "message":
            done = {
                "type": "response.output_text.done",
                **where,
                "text": part["text"],
                "logprobs": [],
            }
        else:
            done = {"type": "response.reasoning_text.done", **where, "text": part["text"]}
        item["status"] = status
        return [
            done,
            {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)},
            self._item_done(item),
        ]

    def _call(self, call_id: str, name: str, arguments: str) -> list[Item]:
        """A function call: it comes whole (ChatReply holds a call until it is complete), so its
        arguments go out as one delta."""
        told = self._close("completed")
        item: Item = {"type": "function_call", "id": _ident("fc"), "call_id": call_id,
                      "name": name, "arguments": "", "status": "in_progress"}  # fmt: skip
        self.items.append(item)
        where = self._where(item)
        told.append({"type": "response.output_item.added", "output_index": where["output_index"],
                     "item": copy.deepcopy(item)})  # fmt: skip
        item.update(arguments=arguments, status="completed")
        told.append({"type": "response.function_call_arguments.delta", **where, "delta": arguments})
        told.append({"type": "response.function_call_arguments.done", **where,
                     "arguments": arguments})  # fmt: skip
        return [*told, self._item_done(item)]

    def _where(self, item: Item | None = None) -> dict[str, Any]:
        item = item if item is not None else self.open
        assert item is not None
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _item_done(self, item: Item) -> Item:
        return {"type": "response.output_item.done", "output_index": self.items.index(item),
                "item": copy.deepcopy(item)}  # fmt: skip


class ResponseWriter:
    """One response in the Responses API's wire format, whole or as its stream events (each
    numbered by sequence_number); a finished response goes into the store unless the request
    said store false."""

    def __init__(self, store: ResponseStore, request: ResponsesRequest, model_name: str) -> None:
        assert request.reply is not None
        self.store = store
        self.request = request
        self.reply: ChatReply = request.reply
        self.output = OutputItems()
        self.model_name = model_name
        self.ident = _ident("resp")
        self.created_at = int(time.time())
        self.sequence = 0
        self.reasoning_tokens = 0

    def whole(self, events: list[StreamEvent], queued_s: float) -> dict[str, Any]:
        """The response of a request that was not streamed: its events fed as a stream's are,
        so that both are built by one rule."""
        for event in events:
            self._feed(event)
        return self._finish(events[-1])

    def opening(self) -> list[bytes]:
        response = self._response("in_progress", [], None)
        return [self._sse({"type": kind, "response": response})
                for kind in ("response.created", "response.in_progress")]  # fmt: skip

    def frames(self, event: StreamEvent, queued_s: float) -> list[bytes]:
        told = self._feed(event)
        if self.request.timings_per_token:
            told = [{**one, "timings": timings(event)} for one in told]
        if event.finish_reason is not None:
            response = self._finish(event)
            told.append(
                {"type": f"response.{response['status']}", "response": response,
                 "timings": timings(event)}
            )  # fmt: skip
        return [self._sse(one) for one in told]

    def progress(self, progress: PromptProgress) -> list[bytes]:
        """response.in_progress again, with llama-server's prompt_progress."""
        response = self._response("in_progress", [], None)
        told = {"type": "response.in_progress", "response": response,
                "prompt_progress": progress_json(progress)}  # fmt: skip
        if self.request.timings_per_token:
            told["timings"] = progress_timings(progress)
        return [self._sse(told)]

    def failure(self, error: dict[str, Any]) -> bytes:
        """A stream that failed after it began: OpenAI's error event, then response.failed
        with what was written so far."""
        said = error.get("error") or {}
        message = str(said.get("message", "the server failed on this request"))
        failed = self._response("failed", self.output.items, None)
        # the codes a response's error may have: the request's own fault, or the server's
        code = "invalid_prompt" if said.get("type") == "invalid_request_error" else "server_error"
        failed["error"] = {"code": code, "message": message}
        return self._sse(
            {"type": "error", "code": said.get("code"), "message": message,
             "param": said.get("param")}
        ) + self._sse({"type": "response.failed", "response": failed})  # fmt: skip

    def _feed(self, event: StreamEvent) -> list[Item]:
        """The stream events one scheduler event releases."""
        splitter = self.reply.splitter
        was_reasoning = splitter.in_reasoning
        finished = event.finish_reason is not None
        told = [one for delta in self.reply.feed(event.text, finished)
                for one in self.output.add(delta)]  # fmt: skip
        if event.token is not None and splitter.pushed_thinking(was_reasoning):
            self.reasoning_tokens += 1
        if finished:
            told += self.output.finish(self._status(event))
        return told

    def _finish(self, last: StreamEvent) -> dict[str, Any]:
        response = self._response(self._status(last), self.output.items, self._usage(last))
        if self.request.store:
            sent_back = [_item(item, "output") for item in self.output.items]
            self.store.put(response, self.request.conversation + sent_back)
        return response

    @staticmethod
    def _status(last: StreamEvent) -> str:
        return "incomplete" if last.finish_reason == "length" else "completed"

    def _response(
        self, status: str, output: list[Item], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.ident,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model_name,
            "output": copy.deepcopy(output),
            **self.request.echo,
            "usage": usage,
        }

    def _usage(self, last: StreamEvent) -> dict[str, Any]:
        """OpenAI's usage: cached_tokens are the prompt tokens the prefix cache reused;
        cache_write_tokens those prefilled, which the slot's cache now holds for a next request."""
        cached = last.cached_prompt_tokens
        return {
            "input_tokens": last.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": last.prompt_tokens - cached,
            },
            "output_tokens": last.generation_tokens,
            "output_tokens_details": {
                "reasoning_tokens": min(self.reasoning_tokens, last.generation_tokens)
            },
            "total_tokens": last.prompt_tokens + last.generation_tokens,
        }

    def _sse(self, event: Item) -> bytes:
        payload = {**event, "sequence_number": self.sequence}
        self.sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(payload)}\n\n".encode()

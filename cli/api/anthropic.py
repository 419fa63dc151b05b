"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over quill's
scheduler: a request is read into the chat request the OpenAI route makes, and the events go
out as Anthropic's content blocks and stream events.

The Anthropic body is translated into an OpenAI chat-completions body and handed to
parse_request, so the chat template, tools, forced calls, sampling bounds, stop strings and the
context check are the OpenAI route's own; only what Anthropic says differently is checked here
(max_tokens required, temperature 0 to 1, block types, tool_result ids). ChatReply splits the
reply into reasoning, text and tool calls, which go out as thinking, text and tool_use blocks.
"""

from __future__ import annotations

import json
import uuid
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from cli.api.replies import ChatReply
from cli.api.server import (
    ApiError,
    OneChoice,
    ServedRequest,
    ServerLimits,
    bad_request,
    parse_request,
    text_field,
    typed_field,
)
from cli.engine.events import PromptProgress, StreamEvent

if TYPE_CHECKING:
    from cli.engine.engine import Engine

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}


def anthropic_error(error: ApiError) -> dict[str, Any]:
    """An error as Anthropic's API writes one."""
    kind = ERROR_TYPES.get(error.status)  # type: ignore[call-overload]
    if kind is None:
        kind = "api_error" if error.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": error.message}}


# --- the request: an Anthropic body as the OpenAI chat body parse_request reads ----------------

# The blocks each role's message may hold. thinking is kept (as the template's reasoning_content,
# which templates such as Qwen3's render within a tool loop); redacted_thinking is dropped: its
# data is Anthropic's encryption, nothing a local model wrote or can read.
BLOCKS = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
    "system": ("text",),
    "tool_result": ("text",),
}
READ_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": one named
THINKING = ("enabled", "adaptive", "disabled")
# parse_request names OpenAI's fields: its refusals of what was passed on to it name the field
# the Anthropic client sent instead.
OPENAI_NAMES = (
    ("'stop'", "'stop_sequences'"),
    (".function.parameters", ".input_schema"),
    (".function.name", ".name"),
)


def _openai_body(body: dict, counting: bool) -> dict[str, Any]:
    """The OpenAI chat body that asks for what body asks for (counting: for count_tokens,
    which reads only what makes the prompt)."""
    chat: dict[str, Any] = {"messages": _conversation(body)}
    tools, choice = _tools(body.get("tools")), _tool_choice(body.get("tool_choice"))
    chat.update({key: value for key, value in (("tools", tools), ("tool_choice", choice)) if value})
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": thinking}
    if counting:
        return chat
    if body.get("max_tokens") is None:
        raise bad_request(
            "'max_tokens' is required: the most tokens the reply may have", "max_tokens"
        )
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise bad_request("'metadata' must be an object", "metadata")
    chat["max_tokens"] = body["max_tokens"]  # its type and bounds: parse_request's
    chat["stream"] = body.get("stream")
    chat.update(_sampling(body))
    if body.get("stop_sequences") is not None:
        chat["stop"] = _stop_sequences(body["stop_sequences"])
    return chat


def _sampling(body: dict) -> dict[str, Any]:
    """temperature in Anthropic's range (0 to 1; OpenAI's goes to 2), top_p and top_k as sent."""
    sampling = {name: body[name] for name in ("top_p", "top_k") if body.get(name) is not None}
    temperature = typed_field(body, "temperature", float, None)
    if temperature is not None:
        if not 0 <= temperature <= 1:
            raise bad_request(
                f"'temperature' must be between 0 and 1 (Anthropic's range), got {temperature}",
                "temperature",
            )
        sampling["temperature"] = temperature
    return sampling


def _stop_sequences(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise bad_request("'stop_sequences' must be an array of strings", "stop_sequences")
    return value


def _conversation(body: dict) -> list[dict[str, Any]]:
    """system and messages as OpenAI messages: tool_use blocks become tool_calls, each
    tool_result a tool message, thinking reasoning_content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array of messages", "messages")
    system = body.get("system")
    chat = [] if system is None else [_system(system)]
    calls: dict[str, str] = {}  # the name of each tool_use id met so far
    for index, message in enumerate(messages):
        chat += _turn(message, f"messages[{index}]", calls)
    if messages[-1].get("role") == "assistant":
        # Anthropic continues a final assistant message (a prefill); quill's chat template
        # renders whole turns, and would start a new one after it: refused, not misread.
        raise bad_request(
            "the last message is the assistant's: continuing a prefilled reply is not supported "
            "here; end with a user message",
            "messages",
        )
    return chat


def _system(system: Any) -> dict[str, Any]:
    if isinstance(system, str):
        return {"role": "system", "content": text_field(system, "'system'", "system")}
    if not isinstance(system, list):
        raise bad_request("'system' must be a string or an array of text blocks", "system")
    parts = [_text(_typed_block(block, f"system[{n}]", "system"), f"system[{n}]")
             for n, block in enumerate(system)]  # fmt: skip
    return {"role": "system", "content": parts}


def _turn(message: Any, where: str, calls: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message as the OpenAI messages it makes (a user message of tool results
    makes one tool message each)."""
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object with a role and content", "messages")
    role = message.get("role")
    if role not in BLOCKS:
        got = json.dumps(role)[:40]
        raise bad_request(f'{where}.role must be "user" or "assistant", got {got}', "messages")
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": text_field(content, f"{where}.content", "messages")}]
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or an array of content blocks", "messages"
        )
    blocks = [
        (_typed_block(block, f"{where}.content[{n}]", role), f"{where}.content[{n}]")
        for n, block in enumerate(content)
    ]
    if role == "assistant":
        return [_assistant(blocks, calls)]
    if role == "system":
        return [{"role": "system", "content": [_text(block, at) for block, at in blocks]}]
    return _user(blocks, calls)


def _typed_block(block: Any, where: str, role: str) -> dict[str, Any]:
    """block, if it is a block of a type quill reads that a message of role may hold."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad_request(f"{where} must be a content block: an object with a type", "messages")
    kind = block["type"]
    if kind not in READ_BLOCKS:
        raise bad_request(
            f"{where} is a {json.dumps(kind)[:40]} block, which quill does not take: it reads "
            f"{', '.join(READ_BLOCKS)} blocks (its models read text only)",
            "messages",
        )
    if kind not in BLOCKS[role]:
        held = ", ".join(BLOCKS[role])
        raise bad_request(
            f"{where} is a {kind} block, which cannot be there: {role} content holds {held} "
            "blocks only",
            "messages",
        )
    return block


def _text(block: dict[str, Any], where: str) -> dict[str, str]:
    """A text block as an OpenAI text part (parse_request joins a message's parts)."""
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", "messages")
    return {"type": "text", "text": text_field(text, f"{where}.text", "messages")}


def _assistant(blocks: list[tuple[dict, str]], calls: dict[str, str]) -> dict[str, Any]:
    """An assistant turn: its text, its thinking as reasoning_content, its tool_use blocks as
    tool_calls (whose ids later tool_result blocks must answer)."""
    parts, reasoning, tool_calls = [], [], []
    for block, where in blocks:
        if block["type"] == "text":
            parts.append(_text(block, where))
        elif block["type"] == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise bad_request(f"{where}.thinking must be a string", "messages")
            reasoning.append(text_field(block["thinking"], f"{where}.thinking", "messages"))
        elif block["type"] == "tool_use":
            tool_calls.append(_tool_use_call(block, where))
            calls[block["id"]] = block["name"]
    message: dict[str, Any] = {"role": "assistant", "content": parts}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _tool_use_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    for name, kind, what in (("id", str, "a string"), ("name", str, "a string"),
                             ("input", dict, "an object")):  # fmt: skip
        if not isinstance(block.get(name), kind):
            raise bad_request(f"{where}.{name} must be {what}", "messages")
    function = {"name": block["name"], "arguments": block["input"]}
    return {"id": block["id"], "type": "function", "function": function}


def _user(blocks: list[tuple[dict, str]], calls: dict[str, str]) -> list[dict[str, Any]]:
    """A user turn: each tool_result a tool message, the text blocks between them user
    messages, in the order sent."""
    messages: list[dict[str, Any]] = []
    parts: list[dict[str, str]] = []
    for block, where in blocks:
        if block["type"] == "text":
            parts.append(_text(block, where))
            continue
        if parts:
            messages.append({"role": "user", "content": parts})
            parts = []
        messages.append(_tool_result(block, where, calls))
    if parts or not messages:
        messages.append({"role": "user", "content": parts})
    return messages


def _tool_result(block: dict[str, Any], where: str, calls: dict[str, str]) -> dict[str, Any]:
    """A tool_result as a tool message. is_error has no OpenAI field, and a template renders
    only the text: the text says it ("Error: ..."), or a model could not tell a failure."""
    ident = block.get("tool_use_id")
    if not isinstance(ident, str):
        raise bad_request(f"{where}.tool_use_id must be a string", "messages")
    if ident not in calls:
        raise bad_request(
            f"{where}.tool_use_id {json.dumps(ident)[:70]} answers no tool_use block of an "
            "earlier assistant message",
            "messages",
        )
    content = block.get("content", "")
    if isinstance(content, str):
        parts = [{"type": "text", "text": text_field(content, f"{where}.content", "messages")}]
    elif isinstance(content, list):
        parts = [
            _text(
                _typed_block(item, f"{where}.content[{n}]", "tool_result"), f"{where}.content[{n}]"
            )
            for n, item in enumerate(content)
        ]
    else:
        raise bad_request(
            f"{where}.content must be a string or an array of text blocks", "messages"
        )
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise bad_request(f"{where}.is_error must be true or false", "messages")
    if is_error:
        parts = [{"type": "text", "text": "Error: "}, *parts]
    return {"role": "tool", "tool_call_id": ident, "name": calls[ident], "content": parts}


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Anthropic's tools ({name, description, input_schema}) as OpenAI function tools; their
    names and schemas are checked by parse_request (check_tools)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad_request("'tools' must be an array of tools", "tools")
    return [_tool(tool, f"tools[{index}]") for index, tool in enumerate(value)]


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object with a name and an input_schema", "tools")
    if tool.get("type", "custom") not in (None, "custom"):
        raise bad_request(
            f"{where} is a {json.dumps(tool['type'])[:40]} tool, which Anthropic's servers run; "
            "quill runs none: send tools with a name and an input_schema",
            "tools",
        )
    if not isinstance(tool.get("name"), str):
        raise bad_request(f"{where}.name must be a string", "tools")
    if not isinstance(tool.get("input_schema"), dict):
        raise bad_request(f"{where}.input_schema must be a JSON Schema object", "tools")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", "tools")
    # In the order OpenAI's clients send them: templates write a tool with tojson, key by key.
    function = {"name": tool["name"], "description": description,
                "parameters": tool["input_schema"]}  # fmt: skip
    if description is None:
        del function["description"]
    return {"type": "function", "function": function}


def _tool_choice(value: Any) -> str | dict[str, Any] | None:
    """auto, any (OpenAI's required), tool (one named) or none (no tools in the prompt).
    disable_parallel_tool_use is taken: a forced call is one call already."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (*TOOL_CHOICES, "tool"):
        raise bad_request(
            '\'tool_choice\' must be {"type": "auto"}, {"type": "any"}, {"type": "tool", '
            '"name": ...} or {"type": "none"}',
            "tool_choice",
        )
    typed_field(value, "disable_parallel_tool_use", bool, False, "tool_choice")
    if kind != "tool":
        return TOOL_CHOICES[kind]
    if not isinstance(value.get("name"), str):
        raise bad_request("tool_choice of type tool needs the tool's name", "tool_choice")
    return {"type": "function", "function": {"name": value["name"]}}


def _thinking(value: Any) -> bool | None:
    """The template's thinking switch (None: the server's default). budget_tokens is checked,
    not enforced: the reply's max_tokens bounds thinking and answer together."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in THINKING:
        raise bad_request(
            '\'thinking\' must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"} '
            'or {"type": "disabled"}',
            "thinking",
        )
    if kind == "enabled":
        budget = typed_field(value, "budget_tokens", int, None, "thinking")
        if budget is None or budget < 1:
            raise bad_request(
                "thinking.budget_tokens must be a whole number of at least 1", "thinking"
            )
    return kind != "disabled"


def _parsed(chat: dict[str, Any], engine: Engine, limits: ServerLimits) -> ServedRequest:
    try:
        return parse_request(chat, engine, limits, chat=True)
    except ApiError as error:
        message = error.message
        for openai, anthropic in OPENAI_NAMES:
            message = message.replace(openai, anthropic)
        raise ApiError(error.status, message, error.code, error.param) from None


class AnthropicApi(OneChoice):
    """POST /v1/messages."""

    def parse(self, body: dict, engine: Engine, limits: ServerLimits) -> ServedRequest:
        chat = _openai_body(body, counting=False)
        asked = chat["max_tokens"]
        if isinstance(asked, int) and not isinstance(asked, bool) and asked > limits.max_tokens:
            # Anthropic's max_tokens is required and agents send their own ceiling (Claude
            # Code: 32,000 and more); it bounds the reply, so the server's smaller one does too.
            chat["max_tokens"] = limits.max_tokens
        return _parsed(chat, engine, limits)

    def reply_format(self, body: dict, served: ServedRequest, model_name: str) -> AnthropicReply:
        return AnthropicReply(f"msg_{uuid.uuid4().hex[:24]}", model_name, served)


def count_tokens(body: dict, engine: Engine, limits: ServerLimits) -> dict[str, Any]:
    """POST /v1/messages/count_tokens: the tokens /v1/messages would prefill for body."""
    served = _parsed(_openai_body(body, counting=True), engine, limits)
    return {"input_tokens": len(served.prompt_tokens)}


# --- the reply: content blocks, whole or as Anthropic's stream events --------------------------


def _usage(last: StreamEvent) -> dict[str, int]:
    """Anthropic's usage: input_tokens are those prefilled, apart from those read from the
    prompt cache (the three together are the prompt, as Anthropic counts them)."""
    return {
        "input_tokens": last.prompt_tokens - last.cached_prompt_tokens,
        "output_tokens": last.generation_tokens,
        "cache_read_input_tokens": last.cached_prompt_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_use(ident: str, name: str, arguments: str) -> dict[str, Any]:
    """A call as a tool_use block. Its input must be an object: arguments the model wrote that
    are not one go out as {"arguments": their text}, for the client to see and refuse."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    given = value if isinstance(value, dict) else {"arguments": arguments}
    return {"type": "tool_use", "id": f"toolu_{ident.removeprefix('call_')}", "name": name,
            "input": given}  # fmt: skip


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


# What a stream's error event says for an OpenAI error body, by its type (and code: the drain's
# and a stopped scheduler's are 503s).
STREAM_STATUSES = {"invalid_request_error": 400, "rate_limit_error": 429}
UNAVAILABLE_CODES = ("server_shutting_down", "scheduler_stopped")


# A block as content_block_start opens it, before its deltas.
EMPTY_BLOCKS = {
    "text": {"type": "text", "text": ""},
    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
}


class AnthropicReply:
    """One reply in Anthropic's wire format: a message of content blocks, or its stream (a
    block opens as its first delta comes and stops when another kind of delta comes; a tool
    call is one block, its input one input_json_delta, as ChatReply releases a call whole)."""

    def __init__(self, ident: str, model_name: str, served: ServedRequest) -> None:
        assert served.reply is not None  # a chat request: parse_request made its reply shaper
        self.reply: ChatReply = served.reply
        self.prompt_tokens = len(served.prompt_tokens)
        self.base = {"id": ident, "type": "message", "role": "assistant", "model": model_name}
        self.index = -1  # the stream's last block
        self.open: str | None = None  # the type of the block open in the stream

    def whole(self, events: list[StreamEvent], queued_s: float) -> dict[str, Any]:
        self.reply.feed("".join(event.text for event in events), finished=True)
        message = self.reply.message()
        blocks: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            blocks.append({**EMPTY_BLOCKS["thinking"], "thinking": message["reasoning_content"]})
        if message["content"]:
            blocks.append({"type": "text", "text": message["content"]})
        blocks += [_tool_use(call.id, call.name, call.arguments) for call in self.reply.calls]
        last = events[-1]
        return {**self.base, "content": blocks, **self._stop(last), "usage": _usage(last)}

    def _stop(self, last: StreamEvent) -> dict[str, Any]:
        reason = self.reply.finish_reason(last.finish_reason)
        if reason == "tool_calls":
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if reason == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if last.stop_string is not None:
            return {"stop_reason": "stop_sequence", "stop_sequence": last.stop_string}
        return {"stop_reason": "end_turn", "stop_sequence": None}

    def opening(self) -> list[bytes]:
        """message_start (the prompt's tokens; what the cache held comes in message_delta's
        usage, which the SDK takes over it) and a ping, as Anthropic's stream begins."""
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": 0}
        message: dict[str, Any] = {**self.base, "content": [], "stop_reason": None,
                                   "stop_sequence": None, "usage": usage}  # fmt: skip
        start = _event("message_start", {"type": "message_start", "message": message})
        return [start, _event("ping", {"type": "ping"})]

    def frames(self, event: StreamEvent, queued_s: float) -> list[bytes]:
        finished = event.finish_reason is not None
        frames = [
            frame
            for delta in self.reply.feed(event.text, finished)
            for frame in self._delta_frames(delta)
        ]
        if finished:
            frames += self._close()
            delta = {"type": "message_delta", "delta": self._stop(event), "usage": _usage(event)}
            frames += [
                _event("message_delta", delta),
                _event("message_stop", {"type": "message_stop"}),
            ]
        return frames

    def failure(self, error: dict[str, Any]) -> bytes:
        """An error event in Anthropic's shape, from the OpenAI error body http.py gives."""
        detail = error.get("error") or {}
        status = STREAM_STATUSES.get(str(detail.get("type")), 500)
        if detail.get("code") in UNAVAILABLE_CODES:
            status = HTTPStatus.SERVICE_UNAVAILABLE
        failed = ApiError(status, str(detail.get("message", "the reply failed")))
        return _event("error", anthropic_error(failed))

    def progress(self, progress: PromptProgress) -> list[bytes]:
        """Nothing: Anthropic's stream has no event for a prompt's progress."""
        return []

    def _delta_frames(self, delta: dict[str, Any]) -> list[bytes]:
        """The frames of one of ChatReply's deltas."""
        if "reasoning_content" in delta:
            thinking = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
            return self._into("thinking", thinking)
        if "content" in delta:
            return self._into("text", {"type": "text_delta", "text": delta["content"]})
        frames: list[bytes] = []
        for call in delta.get("tool_calls", ()):
            function = call["function"]
            block = _tool_use(call["id"], function["name"], function["arguments"])
            frames += self._close() + self._start({**block, "input": {}})
            frames.append(self._delta({"type": "input_json_delta",
                                       "partial_json": json.dumps(block["input"])}))  # fmt: skip
            frames += self._close()
        return frames

    def _into(self, kind: str, delta: dict[str, Any]) -> list[bytes]:
        """delta, in a block of kind: the open one, or a new one after closing it."""
        frames = [] if self.open == kind else self._close() + self._start(EMPTY_BLOCKS[kind])
        return [*frames, self._delta(delta)]

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [_event("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return _event("content_block_delta", body)

    def _close(self) -> list[bytes]:
        """The open block's end: a thinking block's signature first (empty: quill signs
        nothing, but clients wait for the delta before the block stops)."""
        if self.open is None:
            return []
        frames = []
        if self.open == "thinking":
            frames.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        stop = {"type": "content_block_stop", "index": self.index}
        return [*frames, _event("content_block_stop", stop)]

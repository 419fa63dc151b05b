"""The OpenAI wire format over the batch scheduler: what a request body may hold (validated,
every refusal an OpenAI error object with its HTTP status), and the JSON bodies and Server-Sent
Events of the replies.

No HTTP here: cli/api/http.py carries these over uvicorn and starlette.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from cli.api.replies import ChatReply, CompletionLogprobs, chat_logprobs
from cli.engine.batching import BatchRequest, BatchScheduler
from cli.engine.events import MAX_TOP_LOGPROBS, StreamEvent, TokenLogprobs
from cli.engine.sampling import SamplingParams
from cli.engine.toolcalls import ToolsError, call_format, check_tools, forcing_grammar
from cli.errors import ChatTemplateError


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096  # the most a request may ask for
    default_max_tokens: int = 512
    # Every stop string is searched for after every token of the request: a cap on their number
    # and size keeps one request from slowing the scheduler's step for everyone.
    max_stop_strings: int = 16
    max_stop_chars: int = 1024


class ApiError(Exception):
    def __init__(
        self,
        status: HTTPStatus,
        message: str,
        kind: str,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, "invalid_request_error", code, param)


@dataclass
class ServerState:
    scheduler: BatchScheduler
    model_name: str
    limits: ServerLimits
    api_key: str | None = None
    created: int = 0
    on_request: Callable[[str], None] | None = None  # one line per finished request


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object. NaN and Infinity are not JSON, though Python's parser
    takes them: refused here, like any other malformed body."""

    def refuse_constant(name: str) -> None:
        raise ValueError(f"{name} is not a JSON value")

    try:
        body = json.loads(raw, parse_constant=refuse_constant)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def _number(body: dict, name: str, kind: type, low: float, high: float, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be a number", name)
    if isinstance(value, float) and not math.isfinite(value):  # 1e400 parses as infinity
        raise bad_request(f"'{name}' must be a finite number, got {value}", name)
    if kind is int and value != int(value):
        raise bad_request(f"'{name}' must be a whole number", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}, got {value}", name)
    return kind(value)


def _text(value: str, what: str, param: str) -> str:
    """value, if it can be encoded as UTF-8: JSON's \\ud800 escapes decode to lone surrogates,
    which are not text and which the tokenizer cannot take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = value[error.start]
        raise bad_request(
            f"{what} holds a lone surrogate \\u{ord(bad):04x} at character {error.start}, which "
            "is not Unicode text; send a valid UTF-16 pair or the character itself",
            param,
        ) from None
    return value


def _content(content: Any, index: int) -> str:
    """A message's content: a string, or an array of content parts whose text parts are joined."""
    where = f"messages[{index}].content"
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if not isinstance(part, dict):
                raise bad_request(f"{where}[{number}] must be an object", "messages")
            if part.get("type", "text") != "text":
                continue  # images and audio: this server reads text only
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}[{number}].text must be a string", "messages")
            texts.append(text)
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{where} must be a string or an array of content parts", "messages")
    return _text(content, where, "messages")


def _stop_strings(body: dict, limits: ServerLimits) -> tuple[str, ...]:
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    if len(stop) > limits.max_stop_strings:
        raise bad_request(
            f"'stop' has {len(stop)} strings; this server takes at most {limits.max_stop_strings}",
            "stop",
        )
    total = sum(len(s) for s in stop)
    if total > limits.max_stop_chars:
        raise bad_request(
            f"the stop strings have {total} characters in all; this server takes at most "
            f"{limits.max_stop_chars}",
            "stop",
        )
    return tuple(_text(s, "a stop string", "stop") for s in stop)


def parse_request(body: dict, state: ServerState, chat: bool) -> tuple[list[int], BatchRequest]:
    """Validate an OpenAI request body; the prompt tokens and the request for the scheduler."""
    engine = state.scheduler.engine
    model = body.get("model")
    known = (state.model_name, state.model_name.partition(":")[0], "quill")
    if model is not None and model not in known:
        raise ApiError(
            HTTPStatus.NOT_FOUND,
            f"The model '{model}' does not exist; this server has '{state.model_name}'",
            "invalid_request_error",
            "model_not_found",
            "model",
        )
    reply, grammar = None, None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array", "messages")
        pairs = [_message(message, index) for index, message in enumerate(messages)]
        reply, prompt, grammar = _chat_prompt(body, engine, pairs)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' must be a non-empty string", "prompt")
        _text(prompt, "'prompt'", "prompt")
    if body.get("n", 1) != 1:
        raise bad_request("only n=1 is supported", "n")
    limits = state.limits
    requested = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number(
        {"max_tokens": requested}, "max_tokens", int, 1, limits.max_tokens, None
    ) or min(limits.default_max_tokens, limits.max_tokens)
    defaults = SamplingParams()
    sampling = SamplingParams(
        temperature=_number(body, "temperature", float, 0, 2, defaults.temperature),
        top_p=_number(body, "top_p", float, 0, 1, defaults.top_p),
        top_k=_number(body, "top_k", int, 0, 1 << 20, defaults.top_k),
        min_p=_number(body, "min_p", float, 0, 1, defaults.min_p),
        repeat_penalty=_number(body, "repeat_penalty", float, 0, 10, defaults.repeat_penalty),
        frequency_penalty=_number(body, "frequency_penalty", float, -2, 2, 0.0),
        presence_penalty=_number(body, "presence_penalty", float, -2, 2, 0.0),
        seed=_number(body, "seed", int, 0, 2**32 - 2, None),  # llama.cpp: uint32, max = random
        ignore_eos=bool(body.get("ignore_eos", False)),  # llama-server's extension
        grammar=grammar,
    )
    stop = _stop_strings(body, limits)
    sampling = _with_constraint(body, sampling, engine)
    tokens = engine.tokenize(prompt)
    if len(tokens) + 1 > engine.n_ctx:
        raise bad_request(
            f"This model's context holds {engine.n_ctx} tokens per request, but the prompt has "
            f"{len(tokens)}; shorten it",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    max_tokens = min(max_tokens, engine.n_ctx - len(tokens))
    cache_prompt = body.get("cache_prompt", True)  # llama-server's extension, on by default
    if not isinstance(cache_prompt, bool):
        raise bad_request("'cache_prompt' must be true or false", "cache_prompt")
    logprobs = _logprobs_request(body, chat)
    if chat:
        request: BatchRequest = ChatBatchRequest(
            tokens, max_tokens, sampling, stop, cache_prompt=cache_prompt, reply=reply
        )
        request.logprobs = logprobs
        return tokens, request
    return tokens, BatchRequest(
        tokens, max_tokens, sampling, stop, cache_prompt=cache_prompt, logprobs=logprobs
    )


def _logprobs_request(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's logprobs list (None: no logprobs): chat's logprobs
    (true/false) and top_logprobs, completions' logprobs (a count), or llama-server's n_probs
    on either (0: none)."""
    most = MAX_TOP_LOGPROBS
    asked = body.get("logprobs")
    if chat:
        if asked is not None and not isinstance(asked, bool):
            raise bad_request(
                "'logprobs' must be true or false on /v1/chat/completions ('top_logprobs' says "
                "how many alternatives)",
                "logprobs",
            )
        top = _number(body, "top_logprobs", int, 0, most, None)
        if top is not None and not asked:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        wanted = (top or 0) if asked else None
    else:
        if "top_logprobs" in body:
            raise bad_request(
                "'top_logprobs' is a field of /v1/chat/completions; on /v1/completions "
                "'logprobs' is the number of alternatives",
                "top_logprobs",
            )
        if isinstance(asked, bool):
            raise bad_request(
                "'logprobs' on /v1/completions is the number of alternatives per token "
                f"(0 to {most}), not true or false",
                "logprobs",
            )
        wanted = _number(body, "logprobs", int, 0, most, None)
    n_probs = _number(body, "n_probs", int, 0, most, None)  # llama-server's name
    if n_probs:
        if wanted is not None and wanted != n_probs:
            raise bad_request(
                f"'n_probs' ({n_probs}) and the logprobs fields ({wanted} alternatives) "
                "disagree; send one of them",
                "n_probs",
            )
        wanted = n_probs
    return wanted


@dataclass
class ChatBatchRequest(BatchRequest):
    """A chat request: what shapes its reply (reasoning, tool calls) rides with it."""

    reply: ChatReply | None = None


def _message(message: Any, index: int) -> dict[str, Any]:
    """One message of the request, checked, as the chat template reads it: system, user,
    assistant (with tool_calls, content then may be null) and tool results."""
    roles = ("system", "user", "assistant", "developer", "tool")
    if not isinstance(message, dict) or message.get("role") not in roles:
        raise bad_request(
            f"messages[{index}] needs a role of system, user, assistant or tool", "messages"
        )
    role = "system" if message["role"] == "developer" else message["role"]
    calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    if content is None and (calls or role == "assistant"):
        content = ""
    item: dict[str, Any] = {"role": role, "content": _content(content, index)}
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_request(f"messages[{index}].tool_calls must be an array", "messages")
        item["tool_calls"] = [_template_call(call, index) for call in calls]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                item[key] = message[key]
    reasoning = message.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str):
        item["reasoning_content"] = reasoning
    return item


def _template_call(call: Any, index: int) -> dict[str, Any]:
    """An OpenAI tool call as templates read it: arguments as an object (Llama 3.x and Qwen
    templates serialise it themselves with tojson), kept as text where it is not JSON."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"messages[{index}].tool_calls: each needs a function name", "messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": function["name"], "arguments": arguments},
    }


def _chat_prompt(
    body: dict, engine: Any, messages: list[dict[str, Any]]
) -> tuple[ChatReply, str, str | None]:
    """The prompt through the model's template (tools and the thinking switch included), the
    reply shaper for it, and the grammar that forces a call when tool_choice asks for one."""
    try:
        tools, required = check_tools(body.get("tools"), body.get("tool_choice"))
    except ToolsError as error:
        raise bad_request(str(error), error.param) from None
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_request("enable_thinking must be true or false", "chat_template_kwargs")
    try:
        prompt, _ = engine.conversation_text(messages, tools, thinking)
    except ChatTemplateError as error:
        raise bad_request(str(error), "messages", "chat_template_error") from None
    _text(prompt, "the prompt the template made (from messages and tools)", "tools")
    template = engine.chat_template
    fmt = call_format(template.family if template is not None else "unknown")
    try:
        grammar = forcing_grammar(tools, required, fmt) if tools and required else None
    except ToolsError as error:
        raise bad_request(str(error), error.param) from None
    return ChatReply(prompt, tools, fmt), prompt, grammar


def _with_constraint(body: dict, sampling: SamplingParams, engine) -> SamplingParams:
    """response_format, json_schema or grammar: the grammar the sequence samples under."""
    from cli.api.structured_request import constraint_from_body
    from cli.engine.grammar import GrammarError, check_grammar

    constraint = constraint_from_body(body, bad_request)
    if constraint is None:
        if sampling.grammar:  # a forced tool call's: checked (and tried) as any other
            try:
                check_grammar(engine.vocab_handle, sampling.grammar)
            except GrammarError as error:
                raise bad_request(str(error), "tools") from None
        return sampling
    if sampling.ignore_eos:
        raise bad_request("ignore_eos cannot go with a grammar: the reply ends where it does")
    try:
        check_grammar(engine.vocab_handle, constraint.grammar)
    except GrammarError as error:
        raise bad_request(str(error), "grammar") from None
    return dataclasses.replace(sampling, grammar=constraint.grammar)


def timings(last: StreamEvent, queued_s: float) -> dict[str, float]:
    """llama-server's timings object, plus TTFT: prefill and decode ms and tokens/s."""
    return {
        # llama-server's names: cache_n prompt tokens reused from the slot's cache, prompt_n
        # the rest, which were prefilled.
        "cache_n": last.cached_prompt_tokens,
        "prompt_n": last.prompt_tokens - last.cached_prompt_tokens,
        "prompt_ms": last.prefill_s * 1000,
        "prompt_per_second": last.prefill_tokens_per_s,
        "predicted_n": last.generation_tokens,
        "predicted_ms": last.decode_s * 1000,
        "predicted_per_second": last.decode_tokens_per_s,
        "ttft_ms": (queued_s + last.prefill_s) * 1000,
    }


def _usage(last: StreamEvent) -> dict[str, Any]:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.generation_tokens,
        "total_tokens": last.prompt_tokens + last.generation_tokens,
        "prompt_tokens_details": {"cached_tokens": last.cached_prompt_tokens},
    }


def completion_body(
    ident: str,
    chat: bool,
    model_name: str,
    text: str,
    last: StreamEvent,
    queued_s: float,
    reply: ChatReply | None = None,
    logprobs: list[TokenLogprobs] | None = None,
) -> dict[str, Any]:
    """The whole reply of a request that did not ask to stream (logprobs: its tokens' entries,
    None where the request asked for none)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason}
    choice["logprobs"] = _choice_logprobs(chat, logprobs, CompletionLogprobs())
    if chat and reply is not None:
        reply.feed(text, finished=True)
        choice["message"] = reply.message()
        choice["finish_reason"] = reply.finish_reason(last.finish_reason)
    elif chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": ident,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [choice],
        "usage": _usage(last),
        "timings": timings(last, max(queued_s, 0.0)),
    }


def _choice_logprobs(
    chat: bool, entries: list[TokenLogprobs] | None, legacy: CompletionLogprobs
) -> dict[str, Any] | None:
    if entries is None:
        return None
    return chat_logprobs(entries) if chat else legacy.shape(entries)


class ChunkMaker:
    """The chunks of one streamed reply, as Server-Sent Events: a first one with the role (chat),
    one per piece of text, a last one with finish_reason, usage and timings, then [DONE].

    Logprobs: hold(event) keeps the entries each event releases; the next chunk carries them
    (an event whose text is all held back, by the reply shaper too, adds its entries to a
    later chunk, the last one at the latest)."""

    DONE = b"data: [DONE]\n\n"

    def __init__(self, ident: str, chat: bool, model_name: str) -> None:
        self.chat = chat
        self._held: list[TokenLogprobs] = []
        self._legacy = CompletionLogprobs()
        self.base = {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }

    def chunk(
        self, delta: str | dict | None, finish: str | None = None, first: bool = False
    ) -> dict:
        if self.chat:
            content: dict[str, Any] = {}
            if first:
                content["role"] = "assistant"
            if isinstance(delta, dict):  # reasoning_content, content or tool_calls
                content.update(delta)
            elif delta is not None:
                content["content"] = delta
            choice = {"index": 0, "delta": content, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": finish}
        held, self._held = self._held, []
        choice["logprobs"] = _choice_logprobs(self.chat, held or None, self._legacy)
        return {**self.base, "choices": [choice]}

    def hold(self, event: StreamEvent) -> None:
        """Keep the logprobs entries event released, for the next chunk."""
        self._held.extend(event.logprobs or ())

    def final(self, last: StreamEvent, queued_s: float, finish: str | None = None) -> dict:
        payload = self.chunk(None if self.chat else "", finish or last.finish_reason)
        payload["usage"] = _usage(last)
        payload["timings"] = timings(last, max(queued_s, 0.0))
        return payload


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"

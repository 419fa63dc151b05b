"""What an OpenAI request body may hold, validated: every refusal is an OpenAI error object with
its HTTP status (cli/api/http.py carries them over uvicorn and starlette; cli/api/replies.py
shapes the replies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Protocol

from cli.api.replies import ChatReply, ReplyWriter, merged_choices
from cli.engine.batching import BatchRequest, BatchScheduler
from cli.engine.events import MAX_TOP_LOGPROBS, PromptProgress, StreamEvent
from cli.engine.sampling import SamplingParams
from cli.engine.structured import (
    Constraint,
    UnenforcedError,
    check_schema,
    grammar_constraint,
    json_object_constraint,
    schema_constraint,
)
from cli.engine.toolcalls import ToolsError, call_format, check_tools, forcing_grammar
from cli.errors import ChatTemplateError, UsageError

if TYPE_CHECKING:
    from cli.engine.embedqueue import EmbeddingScheduler
    from cli.engine.engine import Engine

    Scheduler = BatchScheduler | EmbeddingScheduler


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096  # the most a request may ask for
    default_max_tokens: int = 512
    # The sampling of a request that sets none of a field (quill serve --temp, --seed).
    default_sampling: SamplingParams = field(default_factory=SamplingParams)
    # Every stop string is searched for after every token of the request: a cap on their number
    # and size keeps one request from slowing the scheduler's step for everyone.
    max_stop_strings: int = 16
    max_stop_chars: int = 1024


# Error types by status where OpenAI's and llama-server's clients read one other than
# invalid_request_error (4xx) or server_error (5xx).
ERROR_TYPES = {
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.NOT_IMPLEMENTED: "not_supported_error",
}


class ApiError(Exception):
    """A refusal: an OpenAI error object and its HTTP status, which decides its type unless
    kind names one (llama-server's exceed_context_size_error); extra: more fields of the error
    object (llama-server's n_prompt_tokens and n_ctx)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        kind: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.code = code
        self.param = param
        self.kind = kind
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        kind = self.kind or ERROR_TYPES.get(self.status)  # type: ignore[call-overload]
        if kind is None:
            kind = "server_error" if self.status >= 500 else "invalid_request_error"
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": {**error, **self.extra}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, code, param)


def is_token_id(value: Any, n_vocab: int) -> bool:
    """Whether a JSON value is a token id of a vocabulary of n_vocab tokens (true is no id)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_vocab


def context_exceeded(prompt_tokens: int, n_ctx: int, param: str) -> ApiError:
    """A prompt longer than a request's context: OpenAI's code, llama-server's type and fields."""
    return ApiError(
        HTTPStatus.BAD_REQUEST,
        f"This model's context holds {n_ctx} tokens per request, but the prompt has "
        f"{prompt_tokens}; shorten it",
        "context_length_exceeded",
        param,
        "exceed_context_size_error",
        {"n_prompt_tokens": prompt_tokens, "n_ctx": n_ctx},
    )


@dataclass
class ServerState:
    scheduler: Scheduler | None  # a model loaded before serving (None: none)
    model_name: str
    limits: ServerLimits
    api_key: str | None = None
    created: int = 0
    on_request: Callable[[str], None] | None = None  # one line per finished request
    pool: Any = None  # cli.api.pool.ModelPool; None: a pool of the one model above
    metrics: bool = False  # GET /metrics answers (quill serve --metrics)
    metrics_off_advice: str = "its operator can turn them on"
    slots_listed: bool = True  # GET /slots answers (quill serve --no-slots: 501)
    slots_off_advice: str = "its operator turned it off"


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


def typed_field(body: dict, name: str, kind: type, default, param: str | None = None):
    """body[name] (default where it is absent or null) if it is of kind (bool, int or float)
    as JSON writes one: true is no number, 1.0 no whole number and "false" no boolean, so none of
    them is read as if it were meant."""
    value = body.get(name)
    if value is None:
        return default
    param = param or name
    if kind is bool:
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be true or false, got {shown_json(value)}", param)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be a number, got {shown_json(value)}", param)
    if isinstance(value, float) and not math.isfinite(value):  # 1e400 parses as infinity
        raise bad_request(f"'{name}' must be a finite number, got {value}", param)
    if kind is int and isinstance(value, float):
        raise bad_request(f"'{name}' must be a whole number, got {value}", param)
    return kind(value)


def shown_json(value: Any) -> str:
    """A value as JSON, cut short: an error message quotes what was sent, not all of it."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _number(body: dict, name: str, kind: type, low: float, high: float, default):
    value = typed_field(body, name, kind, None)
    if value is None:
        return default
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}, got {value}", name)
    return kind(value)


def text_field(value: str, what: str, param: str) -> str:
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
                # An image or a sound the model never sees would get an answer about nothing.
                raise bad_request(
                    f"{where}[{number}] is a {shown_json(part.get('type'))} part: this server's "
                    "models read text only; send text parts",
                    "messages",
                    "unsupported_content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}[{number}].text must be a string", "messages")
            texts.append(text)
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad_request(f"{where} must be a string or an array of content parts", "messages")
    return text_field(content, where, "messages")


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
    return tuple(text_field(s, "a stop string", "stop") for s in stop)


# The sampling fields a request may set: type, lowest, highest (seed: llama.cpp's is a uint32 whose
# largest value means random).
SAMPLING_RANGES = {
    "temperature": (float, 0, 2),
    "top_p": (float, 0, 1),
    "top_k": (int, 0, 1 << 20),
    "min_p": (float, 0, 1),
    "repeat_penalty": (float, 0, 10),
    "frequency_penalty": (float, -2, 2),
    "presence_penalty": (float, -2, 2),
    "seed": (int, 0, 2**32 - 2),
}


@dataclass
class ServedRequest(BatchRequest):
    """A request for the scheduler, with what shapes a chat reply (reasoning, tool calls)."""

    reply: ChatReply | None = None  # None: /v1/completions
    choice: int = 0  # which of a request's n choices this is


class ReplyFormat(Protocol):
    """A generation reply in one API's wire format, made from the scheduler's events."""

    def whole(self, events: list[StreamEvent], queued_s: float) -> dict[str, Any]:
        """The body of a reply that was not streamed (queued_s: the wait before prefill)."""
        ...

    def opening(self) -> list[bytes]:
        """The Server-Sent Events a stream begins with, before the first event."""
        ...

    def frames(self, event: StreamEvent, queued_s: float) -> list[bytes]:
        """The Server-Sent Events an event releases; the last event's close the stream."""
        ...

    def failure(self, error: dict[str, Any]) -> bytes:
        """The event that ends a stream which failed after it began (error: its error body)."""
        ...

    def progress(self, progress: PromptProgress) -> list[bytes]:
        """The Server-Sent Events that tell a prompt's prefill progress (return_progress)."""
        ...


class GenerationApi(Protocol):
    """One API's generation route: its request body read into a request for the scheduler,
    and the reply format its events go out in. The HTTP layer does the rest (the model pool,
    streaming, disconnects, the drain, the log line) alike for every API."""

    def parse(self, body: dict, engine: Engine, limits: ServerLimits) -> ServedRequest: ...

    def reply_format(self, body: dict, served: ServedRequest, model_name: str) -> ReplyFormat: ...

    def choices(self, body: dict) -> list[dict]:
        """The body of each sequence the request asks for (OpenAI's n, llama-server's several
        prompts), each parsed and generated on its own; one for most requests."""
        ...

    def merged(self, body: dict, wholes: list[dict[str, Any]]) -> Any:
        """The reply to a request that was not streamed, from its sequences' whole replies."""
        ...


class OneChoice:
    """The choices of an API whose requests are one sequence each."""

    def choices(self, body: dict) -> list[dict]:
        return [body]

    def merged(self, body: dict, wholes: list[dict[str, Any]]) -> Any:
        return wholes[0]


@dataclass(frozen=True)
class OpenAIApi:
    """/v1/chat/completions (chat) and /v1/completions."""

    chat: bool

    def parse(self, body: dict, engine: Engine, limits: ServerLimits) -> ServedRequest:
        return parse_request(body, engine, limits, self.chat)

    def reply_format(self, body: dict, served: ServedRequest, model_name: str) -> ReplyWriter:
        ident = (
            body.get(CHOICES_ID) or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        )
        options = body.get("stream_options") or {}
        usage_chunk = options.get("include_usage") is True
        return ReplyWriter(ident, model_name, served.reply, served.choice, usage_chunk)

    def choices(self, body: dict) -> list[dict]:
        """One body per choice of n (1 to MAX_CHOICES), each its own seed where the request set
        one (seed + i: the choices differ, and repeat), all under one id."""
        n = _number(body, "n", int, 1, MAX_CHOICES, 1)
        if n == 1:
            return [body]
        seed = typed_field(body, "seed", int, None)
        ident = f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        return [
            {
                **body,
                CHOICES_ID: ident,
                **({"seed": (seed + i) % (2**32 - 1)} if seed is not None else {}),
            }
            for i in range(n)
        ]

    def merged(self, body: dict, wholes: list[dict[str, Any]]) -> Any:
        return merged_choices(wholes)


MAX_CHOICES = 8  # OpenAI's n: each choice is a sequence of its own in a slot
CHOICES_ID = "_quill_choices_id"  # the one id a request's choices share (set here, never sent)


def parse_request(
    body: dict,
    engine: Engine,
    limits: ServerLimits,
    chat: bool,
    prompt_tokens: list[int] | None = None,
) -> ServedRequest:
    """An OpenAI request body, validated, as a request for the scheduler of engine
    (prompt_tokens: a completion's prompt already as tokens, read in place of body's prompt, as
    llama-server's /completion takes one: cli/api/native.py)."""
    reply, grammar, prompt = None, None, ""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array", "messages")
        pairs = [_message(message, index) for index, message in enumerate(messages)]
        reply, prompt, grammar = _chat_prompt(body, engine, pairs)
    elif prompt_tokens is None:
        given = body.get("prompt")
        if isinstance(given, list) and len(given) == 1 and isinstance(given[0], str):
            given = given[0]
        if not isinstance(given, str) or not given:
            raise bad_request("'prompt' must be a non-empty string", "prompt")
        prompt = text_field(given, "'prompt'", "prompt")
    typed_field(body, "stream", bool, False)  # read by cli/api/http.py, which trusts it checked
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    typed_field(options or {}, "include_usage", bool, False, "stream_options")
    named = "max_completion_tokens" if body.get("max_completion_tokens") is not None else ""
    default_max = min(limits.default_max_tokens, limits.max_tokens)
    max_tokens = _number(body, named or "max_tokens", int, 1, limits.max_tokens, default_max)
    defaults = limits.default_sampling
    numbers = {
        name: _number(body, name, *bounds, getattr(defaults, name))
        for name, bounds in SAMPLING_RANGES.items()
    }
    ignore_eos = typed_field(body, "ignore_eos", bool, False)  # llama-server's extension
    bias = logit_bias(body.get("logit_bias"), engine)
    sampling = SamplingParams(**numbers, ignore_eos=ignore_eos, grammar=grammar, logit_bias=bias)
    stop = _stop_strings(body, limits)
    sampling = _with_constraint(body, sampling, engine)
    tokens = engine.tokenize(prompt) if prompt_tokens is None else prompt_tokens
    if len(tokens) + 1 > engine.n_ctx:
        raise context_exceeded(len(tokens), engine.n_ctx, "messages" if chat else "prompt")
    max_tokens = min(max_tokens, engine.n_ctx - len(tokens))
    cache_prompt = typed_field(body, "cache_prompt", bool, True)  # llama-server's, on by default
    logprobs = _logprobs_request(body, chat)
    progress = typed_field(body, "return_progress", bool, False)  # llama-server's, streams only
    post_sampling = typed_field(body, "post_sampling_probs", bool, False)  # llama-server's
    return ServedRequest(
        tokens,
        max_tokens,
        sampling,
        stop,
        cache_prompt=cache_prompt,
        logprobs=logprobs,
        progress=progress and bool(body.get("stream")),
        post_sampling=post_sampling,
        reply=reply,
    )


MAX_LOGIT_BIAS = 4096  # entries; each is a token the sampler looks up at every step


def logit_bias(value: Any, engine: Engine) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias}, -100 to 100) and llama-server's forms: a key
    that is text biases each of its tokens, a list of [token or text, bias] pairs, and a bias
    of false bans the token."""
    if value is None:
        return ()
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [tuple(pair) for pair in value]
    else:
        raise bad_request(
            "'logit_bias' must map token ids to biases, or be a list of [token, bias] pairs",
            "logit_bias",
        )
    if len(pairs) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' has over {MAX_LOGIT_BIAS} entries", "logit_bias")
    biased: dict[int, float] = {}
    for key, bias in pairs:
        if bias is False:
            bias = float("-inf")
        elif (
            isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100
        ):
            raise bad_request(
                f"logit_bias[{shown_json(key)}] must be a number from -100 to 100 (or false)",
                "logit_bias",
            )
        for token in _biased_tokens(key, engine):
            biased[token] = float(bias)
    return tuple(biased.items())


def _biased_tokens(key: Any, engine: Engine) -> list[int]:
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        key = int(key)
    if isinstance(key, int) and not isinstance(key, bool):
        if not is_token_id(key, engine.n_vocab):
            raise bad_request(
                f"logit_bias names token {key}, which this model's vocabulary (0 to "
                f"{engine.n_vocab - 1}) lacks",
                "logit_bias",
            )
        return [key]
    if isinstance(key, str):
        text = text_field(key, "a logit_bias key", "logit_bias")
        return engine.vocabulary.tokenize_bytes(text.encode("utf-8"), False)
    raise bad_request("a logit_bias key must be a token id or a text", "logit_bias")


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
    if n_probs and wanted is not None and wanted != n_probs:
        raise bad_request(
            f"'n_probs' ({n_probs}) and the logprobs fields ({wanted} alternatives) disagree; "
            "send one of them",
            "n_probs",
        )
    return n_probs or wanted


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
    if content is None and role == "assistant":  # a message of tool calls only
        content = ""
    item: dict[str, Any] = {"role": role, "content": _content(content, index)}
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_request(f"messages[{index}].tool_calls must be an array", "messages")
        item["tool_calls"] = [_template_call(call, index) for call in calls]
    kept = {"tool": ("tool_call_id", "name"), "assistant": ("reasoning_content",)}.get(role, ())
    item.update({key: message[key] for key in kept if isinstance(message.get(key), str)})
    return item


def apply_template(body: dict, engine: Engine, limits: ServerLimits) -> dict[str, Any]:
    """llama-server's POST /apply-template: the prompt a chat request's messages (and tools)
    make through the model's template, as /v1/chat/completions would prefill it."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", "messages")
    pairs = [_message(message, index) for index, message in enumerate(messages)]
    _, prompt, _ = _chat_prompt(body, engine, pairs)
    return {"prompt": prompt}


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
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    # transformers' (and llama-server's) switches for continuing the last assistant message:
    # quill's prompts always end by opening a new assistant turn, so asking otherwise is refused
    # rather than answered as if it had not been asked.
    for name, default in (("continue_final_message", False), ("add_generation_prompt", True)):
        if typed_field(body, name, bool, default) != default:
            raise bad_request(
                f"'{name}': {str(not default).lower()} is not supported: quill's chat prompts "
                "always end by opening a new assistant turn; send the text to continue as a "
                "/v1/completions prompt",
                name,
            )
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_request("enable_thinking must be true or false", "chat_template_kwargs")
    try:
        tools, required = check_tools(body.get("tools"), body.get("tool_choice"))
        prompt, _ = engine.conversation_text(messages, tools, thinking)
        template = engine.chat_template
        fmt = call_format(template.family if template is not None else "unknown")
        grammar = forcing_grammar(tools, required, fmt) if tools and required else None
    except ToolsError as error:
        raise bad_request(str(error), error.param) from None
    except ChatTemplateError as error:
        raise bad_request(str(error), "messages", "chat_template_error") from None
    text_field(prompt, "the prompt the template made (from messages and tools)", "tools")
    return ChatReply(prompt, tools, fmt), prompt, grammar


def _with_constraint(body: dict, sampling: SamplingParams, engine: Any) -> SamplingParams:
    """response_format, json_schema or grammar (else a forced tool call's): the grammar the
    sequence samples under, checked (and tried) before the request is queued."""
    from cli.engine.grammar import GrammarError, check_grammar

    constraint = _constraint(body)
    if constraint is not None and sampling.grammar:
        # As llama-server refuses a grammar with tools; it lets a response_format win and the
        # forced call go unmade, a 200 that breaks tool_choice's promise.
        raise bad_request(
            f"tool_choice forces a tool call, and {_constraint_fields(body)[0]} constrains a "
            "reply's text, which a tool call does not have (its arguments follow the tool's "
            "parameters schema): the two are not supported together; send one of them",
            "tool_choice",
        )
    if constraint is not None:
        if sampling.ignore_eos:
            raise bad_request("ignore_eos cannot go with a grammar: the reply ends where it does")
        sampling = dataclasses.replace(sampling, grammar=constraint.grammar)
    if sampling.grammar:
        try:
            check_grammar(engine.vocab_handle, sampling.grammar)
        except GrammarError as error:
            raise bad_request(str(error), "tools" if constraint is None else "grammar") from None
    return sampling


# A grammar (or schema) is parsed by llama.cpp for every request: bound what one may send.
MAX_GRAMMAR_CHARS = 64 * 1024


def _constraint(body: dict[str, Any]) -> Constraint | None:
    """The constraint of OpenAI's response_format (json_object, json_schema with strict) or
    llama-server's json_schema and grammar fields; None: free text."""
    asked = _constraint_fields(body)
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_request(f"{' and '.join(asked)} both constrain the output: send one", asked[1])
    key = asked[0]
    try:
        if key == "grammar":
            if not isinstance(body["grammar"], str):
                raise bad_request("'grammar' must be a GBNF string", "grammar")
            return grammar_constraint(_bounded(body["grammar"], "grammar"))
        if key == "json_schema":
            return _schema(body["json_schema"], "json_schema", False)
        return _response_format(body["response_format"])
    except UnenforcedError as error:  # only a strict schema raises it
        raise bad_request(f"strict: {error}", key) from None
    except UsageError as error:  # a schema or grammar that is malformed or over the budget
        raise bad_request(str(error), key) from None


def _constraint_fields(body: dict[str, Any]) -> list[str]:
    return [key for key in ("response_format", "json_schema", "grammar") if body.get(key)]


def _response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a type", "response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        if "schema" in value:  # llama-server's extension
            return _schema(value["schema"], "response_format", False)
        return json_object_constraint()
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                "response_format",
            )
        strict = typed_field(spec, "strict", bool, False, "response_format")
        return _schema(spec["schema"], "response_format", strict)
    raise bad_request(
        f"response_format type {kind!r} is not one of text, json_object, json_schema",
        "response_format",
    )


def _schema(schema: Any, param: str, strict: bool) -> Constraint:
    if not isinstance(schema, dict):
        raise bad_request("a JSON Schema is a JSON object", param)
    _bounded(json.dumps(schema), param)
    check_schema(schema)
    return schema_constraint(schema, strict)


def _bounded(text: str, param: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"'{param}' is over {MAX_GRAMMAR_CHARS} characters", param)
    return text

"""The OpenAI-compatible HTTP API over the batch scheduler: /v1/chat/completions,
/v1/completions, /v1/models, /health.

Standard library HTTP server, one thread per connection; every token is written and flushed as
its own Server-Sent Event. A write that fails means the client went away: its request is
cancelled and its slot freed at the scheduler's next step.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cli.engine.batching import BatchRequest, BatchScheduler
from cli.engine.events import StreamEvent
from cli.engine.sampling import SamplingParams
from cli.errors import QueueFullError


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096  # the most a request may ask for
    default_max_tokens: int = 512


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


def _number(body: dict, name: str, kind: type, low: float, high: float, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be a number", name)
    if kind is int and value != int(value):
        raise bad_request(f"'{name}' must be a whole number", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}, got {value}", name)
    return kind(value)


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
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array", "messages")
        pairs = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in (
                "system",
                "user",
                "assistant",
                "developer",
            ):
                raise bad_request(
                    f"messages[{index}] needs a role of system, user or assistant", "messages"
                )
            content = message.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(
                    part.get("text", "") for part in content if isinstance(part, dict)
                )
            if not isinstance(content, str):
                raise bad_request(f"messages[{index}].content must be a string", "messages")
            role = "system" if message["role"] == "developer" else message["role"]
            pairs.append((role, content))
        prompt, _ = engine.conversation_text(pairs)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' must be a non-empty string", "prompt")
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
        seed=_number(body, "seed", int, 0, 2**63, None),
        ignore_eos=bool(body.get("ignore_eos", False)),  # llama-server's extension
    )
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a string or an array of strings", "stop")
    tokens = engine.tokenize(prompt)
    if len(tokens) + 1 > engine.n_ctx:
        raise bad_request(
            f"This model's context holds {engine.n_ctx} tokens per request, but the prompt has "
            f"{len(tokens)}; shorten it",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    max_tokens = min(max_tokens, engine.n_ctx - len(tokens))
    return tokens, BatchRequest(tokens, max_tokens, sampling, tuple(stop))


def timings(last: StreamEvent, queued_s: float) -> dict[str, float]:
    """llama-server's timings object, plus TTFT: prefill and decode ms and tokens/s."""
    return {
        "prompt_n": last.prompt_tokens,
        "prompt_ms": last.prefill_s * 1000,
        "prompt_per_second": last.prefill_tokens_per_s,
        "predicted_n": last.generation_tokens,
        "predicted_ms": last.decode_s * 1000,
        "predicted_per_second": last.decode_tokens_per_s,
        "ttft_ms": (queued_s + last.prefill_s) * 1000,
    }


class Handler(BaseHTTPRequestHandler):
    server_version = "quill"
    protocol_version = "HTTP/1.1"
    state: ServerState  # set on the subclass serve() makes

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the command logs one line per request itself

    # --- routing ----------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._guard(self._get)

    def do_POST(self) -> None:
        self._guard(self._post)

    def _guard(self, action) -> None:
        try:
            self._authorize()
            action()
        except ApiError as error:
            self._json(error.status, error.body())
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _authorize(self) -> None:
        key = self.state.api_key
        if key is None or self.path == "/health":
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(
                HTTPStatus.UNAUTHORIZED,
                "Incorrect API key provided; send 'Authorization: Bearer KEY'",
                "invalid_request_error",
                "invalid_api_key",
            )

    def _get(self) -> None:
        state = self.state
        if self.path == "/health":
            self._json(
                HTTPStatus.OK,
                {
                    "status": "ok",
                    "slots_processing": state.scheduler.busy_slots,
                    "slots_idle": state.scheduler.engine.parallel - state.scheduler.busy_slots,
                    "requests_waiting": state.scheduler.queued,
                    "decode_steps": state.scheduler.steps,
                    "max_sequences_in_a_step": state.scheduler.max_sequences_in_a_step,
                },
            )
        elif self.path == "/v1/models":
            model = {
                "id": state.model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "quill",
            }
            self._json(HTTPStatus.OK, {"object": "list", "data": [model]})
        else:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no route {self.path}", "invalid_request_error")

    def _post(self) -> None:
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            raise ApiError(HTTPStatus.NOT_FOUND, f"no route {self.path}", "invalid_request_error")
        chat = self.path == "/v1/chat/completions"
        body = self._body()
        _, request = parse_request(body, self.state, chat)
        received = time.perf_counter()
        try:
            self.state.scheduler.submit(request)
        except QueueFullError as error:
            raise ApiError(
                HTTPStatus.TOO_MANY_REQUESTS, str(error), "rate_limit_error", "queue_full"
            ) from None
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        outcome = "client left"
        try:
            if body.get("stream"):
                self._stream(request, ident, chat, received)
            else:
                self._complete(request, ident, chat, received)
            outcome = "200"
        finally:
            request.cancelled.set()  # finished already, or the client left: free the slot
            if self.state.on_request is not None:
                self.state.on_request(
                    f"POST {self.path} {outcome} · {len(request.prompt_tokens)} prompt tokens · "
                    f"{time.perf_counter() - received:.2f} s"
                )

    def _body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise bad_request("Content-Length is not a number") from None
        if length > self.state.limits.max_body_bytes:
            self.close_connection = True
            raise ApiError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the body has {length} bytes; this server takes at most "
                f"{self.state.limits.max_body_bytes}",
                "invalid_request_error",
            )
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError as error:
            raise bad_request(f"the body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        return body

    # --- responses --------------------------------------------------------------------------

    def _json(self, status: HTTPStatus, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _complete(self, request: BatchRequest, ident: str, chat: bool, received: float) -> None:
        pieces, last = [], None
        for event in request.stream():
            pieces.append(event.text)
            last = event
        assert last is not None
        text = "".join(pieces)
        choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        queued_s = time.perf_counter() - received - last.prefill_s - last.decode_s
        self._json(
            HTTPStatus.OK,
            {
                "id": ident,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.state.model_name,
                "choices": [choice],
                "usage": _usage(last),
                "timings": timings(last, max(queued_s, 0.0)),
            },
        )

    def _stream(self, request: BatchRequest, ident: str, chat: bool, received: float) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        created = int(time.time())
        base = {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.state.model_name,
        }

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                content: dict[str, Any] = {}
                if first:
                    content["role"] = "assistant"
                if delta is not None:
                    content["content"] = delta
                choice = {"index": 0, "delta": content, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish}
            return {**base, "choices": [choice]}

        first_at = None
        if chat:
            self._event(chunk("", None, first=True))
        for event in request.stream():
            if first_at is None:
                first_at = time.perf_counter()
            if event.text:
                self._event(chunk(event.text, None))
            if event.finish_reason is not None:
                final = chunk(None if chat else "", event.finish_reason)
                queued_s = (first_at - received) - event.prefill_s
                final["usage"] = _usage(event)
                final["timings"] = timings(event, max(queued_s, 0.0))
                self._event(final)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()


def _usage(last: StreamEvent) -> dict[str, int]:
    return {
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.generation_tokens,
        "total_tokens": last.prompt_tokens + last.generation_tokens,
    }


def make_server(host: str, port: int, state: ServerState) -> ThreadingHTTPServer:
    handler = type("QuillHandler", (Handler,), {"state": state})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server

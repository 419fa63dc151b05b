"""quill serve's HTTP layer: starlette routes on uvicorn's HTTP/1.1 server (h11) in front of
quill's batch scheduler. h11 frames requests strictly (a body is never read as a next request;
a malformed length is a 400); uvicorn keeps connections alive and flow-controls them. Added here,
for clients that may be hostile: a cap on open connections (429, close); deadlines for a
request's headers (slowloris: 408, close) and its body, whose size is capped as it arrives; a
JSON error object for every error, h11's own 400s included; the Host header checked on a
loopback address (DNS rebinding); CORS only for the origins given; OPTIONS and HEAD answered; a
request cancelled as soon as its client disconnects; a drain on SIGTERM or Ctrl-C (no new
requests, in-flight ones run until the drain timeout, then each stream ends with an error event,
and the process exits 0); a request's failure is its own 500, and a dead scheduler makes /health
say so and every request a 503, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import h11
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from cli import __version__
from cli.api.anthropic import AnthropicApi, count_tokens
from cli.api.metrics import CONTENT_TYPE, ServerMetrics
from cli.api.native import NativeCompletionApi
from cli.api.pool import ModelPool, PooledModel, parse_duration
from cli.api.replies import ReplyWriter
from cli.api.responses import ResponsesApi, ResponseStore
from cli.api.server import (
    ApiError,
    GenerationApi,
    OpenAIApi,
    ReplyFormat,
    ServedRequest,
    ServerLimits,
    ServerState,
    apply_template,
    bad_request,
    parse_body,
)
from cli.api.tokens import detokenize, tokenize
from cli.engine.batching import BatchScheduler, SchedulerStoppedError
from cli.engine.embedqueue import EmbeddingScheduler
from cli.engine.events import PromptProgress, StreamEvent
from cli.errors import InvalidOutputError, QueueFullError, UsageError

if TYPE_CHECKING:
    from cli.engine.engine import Engine

# A route answered from a model's engine: (body, engine, limits) -> the reply's JSON.
EngineAnswer = Callable[[dict, "Engine", ServerLimits], dict[str, Any]]

LISTEN_BACKLOG = 2048
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this
LINGER_S = 1.0  # reading what a client still sends after its request was refused, at most
MAX_HEADER_BYTES = 16 * 1024  # request line and headers together
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ROUTE_METHODS = {
    "/v1/chat/completions": "POST, OPTIONS",
    "/v1/completions": "POST, OPTIONS",
    "/v1/models": "GET, HEAD, OPTIONS",
    "/health": "GET, HEAD, OPTIONS",
    "/api/ps": "GET, HEAD, OPTIONS",
    "/models/unload": "POST, OPTIONS",
    "/v1/embeddings": "POST, OPTIONS",
    "/v1/rerank": "POST, OPTIONS",
    "/v1/messages": "POST, OPTIONS",
    "/v1/messages/count_tokens": "POST, OPTIONS",
    "/v1/responses": "POST, OPTIONS",
    "/tokenize": "POST, OPTIONS",
    "/detokenize": "POST, OPTIONS",
    "/metrics": "GET, HEAD, OPTIONS",
    "/completion": "POST, OPTIONS",
    # llama-server's paths: its native completion (/completions too), the OpenAI routes
    # without /v1, and its own.
    "/completions": "POST, OPTIONS",
    "/chat/completions": "POST, OPTIONS",
    "/models": "GET, HEAD, OPTIONS",
    "/embeddings": "POST, OPTIONS",
    "/rerank": "POST, OPTIONS",
    "/reranking": "POST, OPTIONS",
    "/v1/reranking": "POST, OPTIONS",
    "/responses": "POST, OPTIONS",
    "/v1/health": "GET, HEAD, OPTIONS",
    "/props": "GET, HEAD, OPTIONS",
    "/apply-template": "POST, OPTIONS",
    "/slots": "GET, HEAD, OPTIONS",
    "/v1/responses/input_tokens": "POST, OPTIONS",
    "/v1/chat/completions/input_tokens": "POST, OPTIONS",
    "/chat/completions/input_tokens": "POST, OPTIONS",
}


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 1024
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host header
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0


def raw_error_response(error: ApiError, path: str = "") -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for the protocol layer, where no
    valid request exists to answer through the application (path: where the request line said
    it went, for the error's shape)."""
    shape = error_shape(path)
    body = json.dumps(shape(error) if shape is not None else error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class JsonResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> JsonResponse:
    return JsonResponse(error.body(), status_code=error.status, headers=headers)


# --- the protocol: connection cap, header deadline, JSON for h11's own errors ---------------------


class QuillH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a cap on connections and a deadline on request headers."""

    limits: HttpLimits = HttpLimits()  # set on the subclass make_protocol() returns

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._request_start = b""
        self._lingering = False
        self._close_now = transport.close
        transport.close = self._close_lingering  # type: ignore[method-assign]
        self._header_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections:
            self.app = _too_many_connections  # this connection's request: a 429, then close
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # the rest of a refused request's body: read, so the close is no reset
        if self.conn.their_state is h11.IDLE:  # a request begins: its line, for send_400_response
            self._request_start = data[:256]
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # a next request on a kept-alive connection has begun
        else:
            self._disarm_header_timer()  # its request line and headers are complete

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _close_lingering(self) -> None:
        """Close; but while the client may still be sending a body the server never read (a
        413 or 400 answered first), end the writing side and read on for a moment before the
        close: closing with unread bytes sends a reset, which can destroy the answer before the
        client reads it (nginx's lingering close)."""
        if self._lingering or self.conn.their_state is not h11.SEND_BODY:
            self._close_now()
            return
        self._lingering = True
        with contextlib.suppress(OSError, RuntimeError, NotImplementedError):
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self._close_now)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(
                self.limits.header_timeout_s, self._header_timeout
            )

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # still answering the previous request
        partial, _ = self.conn.trailing_data
        if partial:  # part of a request came: say why the connection ends
            timeout = self.limits.header_timeout_s
            message = f"the request line and headers did not arrive within {timeout:g} s"
            self.transport.write(
                raw_error_response(
                    ApiError(HTTPStatus.REQUEST_TIMEOUT, message, "header_timeout"),
                    _path_of(self._request_start),
                )
            )
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """h11 refused the request (a malformed line or header, a negative Content-Length,
        conflicting framing): a JSON 400, then close, as the framing can no longer be trusted."""
        if self.cycle is None or not self.cycle.response_started:  # else: mid-way through a reply
            message = (
                "malformed HTTP request (request line, headers or body framing); "
                "send HTTP/1.1 with a valid Content-Length or chunked body"
            )
            error = ApiError(HTTPStatus.BAD_REQUEST, message, "malformed_http")
            self.transport.write(raw_error_response(error, _path_of(self._request_start)))
        self.transport.close()


def make_protocol(limits: HttpLimits) -> type[QuillH11Protocol]:
    return type("QuillProtocol", (QuillH11Protocol,), {"limits": limits})


async def _too_many_connections(scope: Scope, receive: Receive, send: Send) -> None:
    message = "too many open connections to this server; retry shortly"
    error = ApiError(HTTPStatus.TOO_MANY_REQUESTS, message, "too_many_connections")
    await error_response(error, {"Connection": "close", "Retry-After": "1"})(scope, receive, send)


DISCONNECTED = object()  # put into a request's queue when its client goes away


class LoopEvents(asyncio.Queue):
    """A request's event queue, in place of BatchRequest.events: the scheduler thread puts, a
    coroutine awaits, and the scheduler stays unaware of asyncio."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.get_running_loop()
        self.outcome = "client left"  # for the request's log line
        self.first_at: float | None = None  # when the first event came
        self.last: StreamEvent | None = None  # the finishing event, once it came

    def took(self, item: StreamEvent) -> None:
        """item came off the queue."""
        self.first_at = self.first_at or time.perf_counter()
        if item.finish_reason is not None:
            self.last = item

    def put(self, item: Any) -> None:  # type: ignore[override]  # from the scheduler's thread
        # A closed loop: the server has stopped and nobody waits for this any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.put_nowait, item)


class QuillApp:
    """The routes, and the state they share: draining, the requests in flight."""

    def __init__(self, state: ServerState, limits: HttpLimits) -> None:
        self.state = state
        self.pool: ModelPool = state.pool or ModelPool()
        if state.pool is None and state.scheduler is not None:
            self.pool.add_loaded(state.model_name, state.scheduler)
        self.limits = limits
        self.draining = False
        self.in_flight: set[LoopEvents] = set()
        self._waiting_limiter: anyio.CapacityLimiter | None = None
        self.responses = ResponseStore()
        self.metrics = ServerMetrics(self.pool) if state.metrics else None
        routes = self._routes()
        # ApiError and HTTPException are answered where raised; any other exception is then
        # raised on to __call__, which logs it.
        handlers = dict.fromkeys((ApiError, HTTPException, Exception), self._error)
        self.routes = Starlette(routes=routes, exception_handlers=handlers)
        inner: Any = self.routes
        if limits.cors_origins:
            origins = [origin for origin in limits.cors_origins if origin != "localhost"]
            inner = CORSMiddleware(
                inner,
                allow_origins=origins,
                allow_origin_regex=LOCALHOST_ORIGINS
                if "localhost" in limits.cors_origins
                else None,
                allow_methods=["GET", "POST", "OPTIONS"],
                allow_headers=["Authorization", "Content-Type"],
                max_age=600,
            )
        self.inner = inner

    def _routes(self) -> list[Route]:
        """Every route: OpenAI's, Anthropic's, llama-server's and Ollama's paths."""
        responses = self._generation(ResponsesApi(self.responses))
        counted = (  # routes that count a request's prompt tokens
            ("/v1/responses/input_tokens", ResponsesApi(self.responses)),
            ("/v1/chat/completions/input_tokens", OpenAIApi(chat=True)),
            ("/chat/completions/input_tokens", OpenAIApi(chat=True)),
        )
        chat, native = (
            self._generation(OpenAIApi(chat=True)),
            self._generation(NativeCompletionApi()),
        )
        return [
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", self._generation(OpenAIApi(chat=False)), methods=["POST"]),
            Route("/completion", native, methods=["POST"]),
            Route("/completions", native, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/health", self.health, methods=["GET"]),
            Route("/props", self.props, methods=["GET"]),
            Route("/slots", self.slots, methods=["GET"]),
            Route("/apply-template", self._on_engine(apply_template), methods=["POST"]),
            Route("/api/ps", self.ps, methods=["GET"]),
            Route("/models/unload", self.unload, methods=["POST"]),
            Route("/slots/{id_slot}", self.slot, methods=["POST"]),
            *(Route(path, self._embeddings, methods=["POST"]) for path in EMBEDDING_PATHS),
            *(Route(path, self._embeddings, methods=["POST"]) for path in RERANK_PATHS),
            Route("/v1/messages", self._generation(AnthropicApi()), methods=["POST"]),
            Route("/v1/messages/count_tokens", self._on_engine(count_tokens), methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/responses", responses, methods=["POST"]),
            *(Route(p, self._on_engine(input_tokens(api)), methods=["POST"]) for p, api in counted),
            Route("/v1/responses/{ident}", self._stored_response, methods=["GET", "DELETE"]),
            Route("/tokenize", self._on_engine(tokenize), methods=["POST"]),
            Route("/detokenize", self._on_engine(detokenize), methods=["POST"]),
            Route("/metrics", self._metrics, methods=["GET"]),
        ]

    # --- the outermost layer: Host, OPTIONS, the API key, JSON errors, connection close ---------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        status = 0

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                # Header names as llama-server writes them (Content-Type): HTTP reads them
                # in any case, but clients written against it may compare them as sent.
                titled = [(name.title(), value) for name, value in message.get("headers", [])]
                message = {**message, "headers": titled}
            await send(message)

        try:
            await self._answer(scope, receive, counted_send)
        finally:
            if self.metrics is not None and status:  # else no response went out
                model = scope.get("state", {}).get("model", "")
                self.metrics.request(_route_of(scope["path"]), model, status)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {name.decode("latin-1"): value for name, value in scope["headers"]}
        body_read = (
            headers.get("content-length", b"0") == b"0" and "transfer-encoding" not in headers
        )
        started = False

        async def tracked_receive() -> Message:
            nonlocal body_read
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_read = True
            return message

        held: dict[str, Any] = {}
        shape = error_shape(scope["path"])

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                response_headers = list(message.get("headers", []))
                if message["status"] >= 400 and not body_read:
                    # An unread body would be drained byte by byte: close instead.
                    response_headers.append((b"connection", b"close"))
                message = {**message, "headers": response_headers}
                content_type = dict(response_headers).get(b"content-type", b"")
                json_body = content_type.startswith(b"application/json")
                if message["status"] >= 400 and (shape is not None or not json_body):
                    held["start"], held["body"] = message, b""  # made JSON below
                    return
            elif message["type"] == "http.response.body" and "start" in held:
                held["body"] += message.get("body", b"")
                if message.get("more_body", False):
                    return
                await self._send_as_json(send, held["start"], held.pop("body"), shape)
                return
            await send(message)

        try:
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                await refusal(scope, tracked_receive, guarded_send)
                return
            await self.inner(scope, tracked_receive, guarded_send)
        except ClientDisconnect:
            return
        except Exception as error:  # the request's own failure: a 500, the server goes on
            logging.getLogger("quill.serve").error(
                "%s %s failed: %r", scope["method"], scope["path"], error
            )
            if not started:
                failure = ApiError(
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                    f"the server failed on this request: {error!r}",
                )
                await error_response(failure)(scope, tracked_receive, guarded_send)

    @staticmethod
    async def _send_as_json(
        send: Send, start: Message, text: bytes, shape: ErrorShape | None
    ) -> None:
        """An error response, whatever made it, as the route's API writes errors."""
        status = start["status"]
        error = _error_read_back(status, text)
        body = json.dumps(shape(error) if shape is not None else error.body()).encode()
        unsaid = (b"content-type", b"content-length")  # said anew below
        kept = [(name, value) for name, value in start["headers"] if name.lower() not in unsaid]
        said = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({**start, "headers": kept + said})
        await send({"type": "http.response.body", "body": body})

    def _refusal(self, scope: Scope, headers: dict[str, bytes]) -> Response | None:
        """The response that refuses this request before routing, or None to route it."""
        allowed = self.limits.allowed_hosts
        if allowed is not None and "host" in headers:
            host = _host_name(headers["host"].decode("latin-1"))
            if host not in allowed:
                message = (
                    f"the Host header names '{host}', not this server (listening on a loopback "
                    f"address, it answers only to {', '.join(allowed)})"
                )
                return error_response(ApiError(HTTPStatus.FORBIDDEN, message, "invalid_host"))
        path, method = scope["path"], scope["method"]
        if method == "OPTIONS":
            preflight = "origin" in headers and "access-control-request-method" in headers
            if preflight and self.limits.cors_origins:
                return None  # the CORS middleware answers it
            if path not in ROUTE_METHODS:
                return error_response(_no_route(path))
            return Response(status_code=204, headers={"Allow": ROUTE_METHODS[path]})
        key = self.state.api_key.encode() if self.state.api_key is not None else None
        if key is not None and path not in ("/health", "/v1/health"):
            # OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key.
            bearer = hmac.compare_digest(headers.get("authorization", b""), b"Bearer " + key)
            if not bearer and not hmac.compare_digest(headers.get("x-api-key", b""), key):
                message = (
                    "Incorrect API key provided; send 'Authorization: Bearer KEY' or "
                    "'x-api-key: KEY'"
                )
                return error_response(ApiError(HTTPStatus.UNAUTHORIZED, message, "invalid_api_key"))
        return None

    async def _error(self, request: Request, error: Exception) -> Response:
        if not isinstance(error, HTTPException):
            return error_response(_request_failed(error))
        if error.status_code == 404:
            return error_response(_no_route(request.url.path))
        message = HTTPStatus(error.status_code).phrase
        if error.status_code == HTTPStatus.METHOD_NOT_ALLOWED:
            allow = (error.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; use {allow}"
        return error_response(ApiError(error.status_code, message), dict(error.headers or {}))

    async def health(self, request: Request) -> Response:
        schedulers = [m.scheduler for m in self.pool.loaded() if m.scheduler is not None]
        dead = [s.stopped_reason for s in schedulers if not s.alive]
        error = {"error": "; ".join(dead)} if dead else {}
        status = "error" if error else "shutting_down" if self.draining else "ok"
        payload = {
            "status": status,
            **error,
            "models_loaded": len(schedulers),
            "slots_processing": sum(s.busy_slots for s in schedulers),
            "slots_idle": sum(s.engine.parallel - s.busy_slots for s in schedulers),
            "requests_waiting": sum(s.queued for s in schedulers),
            "decode_steps": sum(s.steps for s in schedulers),
            "max_sequences_in_a_step": max(
                (s.max_sequences_in_a_step for s in schedulers), default=0
            ),
        }
        if len(schedulers) == 1:  # with no --threads, judged again as it decodes
            engine = schedulers[0].engine
            payload.update(threads=engine.threads, threads_auto=engine.core_load is not None)
        return JsonResponse(payload, status_code=200 if status == "ok" else 503)

    async def models(self, request: Request) -> Response:
        """Every model this server serves, with llama-server router's status of each."""
        names = await anyio.to_thread.run_sync(self.pool.names)
        states = {m["name"]: m["status"] for m in self.pool.status()}
        aliases = {name: [name] for name in names}
        for alias, label in self.pool.aliases.items():
            aliases.setdefault(label, [label]).append(alias)
        data = [
            {"id": name, "object": "model", "created": self.state.created, "owned_by": "quill",
             "status": {"value": states.get(name, "unloaded")}, "aliases": aliases[name]}
            for name in names
        ]  # fmt: skip
        return JsonResponse({"object": "list", "data": data})

    async def props(self, request: Request) -> Response:
        """llama-server's GET /props: the model (?model= or the default), its slots, context and
        template, and the settings a request gets when it sets none."""
        limits = self.state.limits

        def answer(model: PooledModel) -> dict[str, Any]:
            engine = self._generating_engine(model)
            template = engine.chat_template
            defaults = limits.default_sampling
            params = {
                "n_predict": limits.default_max_tokens,
                "temperature": defaults.temperature,
                "top_k": defaults.top_k,
                "top_p": defaults.top_p,
                "min_p": defaults.min_p,
                "seed": -1 if defaults.seed is None else defaults.seed,
            }
            return {
                "default_generation_settings": {"n_ctx": engine.n_ctx, "params": params},
                "total_slots": engine.parallel,
                "model_alias": model.label,
                "model_path": str(engine.path),
                "chat_template": template.source if template is not None else "",
                "modalities": {"vision": False, "audio": False},
                "build_info": f"quill {__version__}, llama-cpp-python "
                f"{_version('llama-cpp-python')}",
            }

        return JsonResponse(await self._with_model(request, answer))

    async def slots(self, request: Request) -> Response:
        """llama-server's GET /slots: each slot of the model (?model= or the default), whether
        it holds a request; prompts are not shown (they are other clients')."""
        if not self.state.slots_listed:
            message = f"the slots list is off on this server; {self.state.slots_off_advice}"
            raise ApiError(HTTPStatus.NOT_IMPLEMENTED, message, "slots_off")

        def answer(model: PooledModel) -> list[dict[str, Any]]:
            engine = self._generating_engine(model)
            scheduler = model.scheduler
            assert isinstance(scheduler, BatchScheduler)  # a generating engine's
            return [
                {"id": index, "n_ctx": engine.n_ctx, "is_processing": busy}
                for index, busy in enumerate(scheduler.slots_processing())
            ]

        return JsonResponse(await self._with_model(request, answer))

    async def _with_model(self, request: Request, answer: Callable[[PooledModel], Any]) -> Any:
        """answer(model) for the model ?model= names (or the default), on a worker thread,
        the model held meanwhile."""
        model = await self._acquire(request, {"model": request.query_params.get("model")})
        try:
            return await anyio.to_thread.run_sync(answer, model)
        finally:
            self.pool.release(model)

    async def ps(self, request: Request) -> Response:
        """The loaded models (Ollama's GET /api/ps): memory, slots busy, time until unloaded."""
        return JsonResponse({"models": self.pool.status()})

    async def unload(self, request: Request) -> Response:
        """llama-server router's POST /models/unload {"model": NAME}."""
        body = parse_body(await self._read_body(request))
        if not isinstance(body.get("model"), str):
            raise bad_request("'model' must name the model to unload", "model")
        said = await anyio.to_thread.run_sync(self.pool.stop, body["model"])
        return JsonResponse({"success": True, "message": said})

    async def slot(self, request: Request) -> Response:
        """llama-server's POST /slots/{id}?action=save|restore|erase (cli/api/slots.py)."""
        from cli.api.slots import slot_action, slot_request

        self._refuse_if_unavailable()
        raw = await self._read_body(request)
        body = parse_body(raw) if raw.strip() else {}
        action, index, name = slot_request(
            request.query_params.get("action"), request.path_params["id_slot"], body
        )
        model = request.query_params.get("model") or body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad_request("'model' must name a model", "model")
        answer = await anyio.to_thread.run_sync(
            slot_action, self.pool, model, action, index, name, limiter=self._model_waits()
        )
        return JsonResponse(answer)

    def _generation(self, api: GenerationApi) -> Callable[[Request], Awaitable[Response]]:
        """The endpoint of a generation route in api's wire format."""

        async def endpoint(request: Request) -> Response:
            return await self._generate(request, api)

        return endpoint

    def _on_engine(self, answer: EngineAnswer) -> Callable[[Request], Awaitable[Response]]:
        """The endpoint of a route answered from the named model's engine alone, with no
        generation (tokenize, count tokens): on a worker thread, the model held meanwhile."""

        async def endpoint(request: Request) -> Response:
            self._refuse_if_unavailable()
            body = parse_body(await self._read_body(request))
            keep_alive = _keep_alive(body)
            model = await self._acquire(request, body)
            try:
                engine = self._generating_engine(model)
                reply = await anyio.to_thread.run_sync(answer, body, engine, self.state.limits)
            finally:
                self.pool.release(model, keep_alive)
            return JsonResponse(reply)

        return endpoint

    async def _metrics(self, request: Request) -> Response:
        """GET /metrics: Prometheus's text format, where --metrics turned it on."""
        if self.metrics is None:
            message = f"metrics are off on this server; {self.state.metrics_off_advice}"
            raise ApiError(HTTPStatus.NOT_IMPLEMENTED, message, "metrics_off")
        body = await anyio.to_thread.run_sync(self.metrics.exposition)
        # llama-server's header: when the counters began (a scraper sees a restart)
        started = str(self.state.created)
        return Response(
            body, headers={"Content-Type": CONTENT_TYPE, "Process-Start-Time-Unix": started}
        )

    async def _stored_response(self, request: Request) -> Response:
        """GET /v1/responses/{id} (a stored response) and DELETE (forget it)."""
        ident = request.path_params["ident"]
        if request.method == "DELETE":
            found = self.responses.delete(ident)
            reply: dict[str, Any] | None = (
                {"id": ident, "object": "response.deleted", "deleted": True} if found else None
            )
        else:
            reply = self.responses.retrieve(ident)
        if reply is None:
            message = f"no stored response {ident!r} (unknown, expired, or sent with store false)"
            raise ApiError(HTTPStatus.NOT_FOUND, message, "response_not_found", "response_id")
        return JsonResponse(reply)

    async def _generate(self, request: Request, api: GenerationApi) -> Response:
        self._refuse_if_unavailable()
        body = parse_body(await self._read_body(request))
        keep_alive = _keep_alive(body)
        bodies = api.choices(body)  # one per sequence (OpenAI's n, several prompts)
        model = await self._acquire(request, body)
        try:
            served = await self._submit_choices(bodies, model, api)
        except BaseException:
            self.pool.release(model, keep_alive)
            raise
        queues = [_loop_events(choice) for choice in served]
        received = time.perf_counter()
        self.in_flight.update(queues)

        def finished() -> None:
            for choice in served:
                choice.cancelled.set()  # finished already, or the client left: free the slot
                self._finished_choice(model, choice, received)
            self.pool.release(model, keep_alive)
            first = served[0]
            if self.state.on_request is not None:
                self.state.on_request(
                    f"{request.method} {request.url.path} {queues[0].outcome} · "
                    f"{len(first.prompt_tokens)} prompt tokens ({first.cached_tokens} cached, "
                    f"{first.restored_tokens} from disk)"
                    f"{f' · {len(served)} choices' if len(served) > 1 else ''} · "
                    f"{time.perf_counter() - received:.2f} s"
                )

        async def finished_on_the_loop() -> None:
            finished()  # quick; a sync background task would wait for a worker thread

        replies = [
            api.reply_format(one, choice, model.label)
            for one, choice in zip(bodies, served, strict=True)
        ]
        if body.get("stream"):
            return StreamingResponse(
                self._stream(queues, replies, received),
                # Set as a header, not a media type: starlette would append a charset.
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
                background=BackgroundTask(finished_on_the_loop),
            )
        wholes = []
        try:
            for events, reply in zip(queues, replies, strict=True):
                pieces = await self._gather(request, events)
                if pieces is None:
                    return Response(status_code=499)  # nginx's "client closed"; nobody reads it
                last = pieces[-1]
                queued_s = time.perf_counter() - received - last.prefill_s - last.decode_s
                wholes.append(reply.whole(pieces, queued_s))
        finally:
            finished()
        return JsonResponse(api.merged(body, wholes))

    async def _submit_choices(
        self, bodies: list[dict], model: PooledModel, api: GenerationApi
    ) -> list[ServedRequest]:
        """Each choice's request, parsed and queued; none stays queued if one is refused."""
        served: list[ServedRequest] = []
        try:
            for index, one in enumerate(bodies):
                parsed = await anyio.to_thread.run_sync(self._parse, one, model, api)
                parsed.choice = index
                served.append(self._submit(model, parsed))
        except BaseException:
            for submitted in served:
                submitted.cancelled.set()
            raise
        return served

    def _finished_choice(self, model: PooledModel, choice: ServedRequest, received: float) -> None:
        events = _loop_events(choice)
        self.in_flight.discard(events)
        if self.metrics is not None and events.last is not None:
            assert events.first_at is not None  # the last event came, so a first did
            self.metrics.generation(model.label, events.last, events.first_at - received)

    async def _acquire(self, request: Request, body: dict) -> PooledModel:
        """The model body names, loaded and counted in flight (the caller releases it)."""
        acquired: list[PooledModel] = []  # a request cancelled as it acquires still releases
        try:
            loaded = self.pool.try_acquire_loaded(body.get("model"))
            if loaded is not None:
                request.state.model = loaded.label  # for /metrics
                return loaded
            # Waits for a load or for room: on threads of its own, see _model_waits.
            await anyio.to_thread.run_sync(
                lambda: acquired.append(self.pool.acquire(body.get("model"))),
                limiter=self._model_waits(),
            )
            request.state.model = acquired[0].label
            return acquired[0]
        except BaseException:
            for model in acquired:
                self.pool.release(model, _keep_alive(body))
            raise

    async def _embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings and /v1/rerank (cli/api/embeddings.py), on an embedding model's
        scheduler: every request waiting when a pass starts shares its batches."""
        from cli.api.embeddings import embeddings, rerank

        self._refuse_if_unavailable()
        body = parse_body(await self._read_body(request))
        keep_alive = _keep_alive(body)
        received = time.perf_counter()
        model = await self._acquire(request, body)
        try:
            scheduler = model.scheduler
            if not isinstance(scheduler, EmbeddingScheduler):
                message = (
                    f"{model.label} generates text; embeddings and rerank need a model made "
                    "for them (quill list shows each model's kind)"
                )
                raise bad_request(message, "model", "wrong_model_kind")
            reply = embeddings if request.url.path in EMBEDDING_PATHS else rerank
            answer = await anyio.to_thread.run_sync(
                reply, body, scheduler, model.label, limiter=self._model_waits()
            )
        except (QueueFullError, SchedulerStoppedError) as error:
            raise self._scheduler_refusal(model, error) from None
        finally:
            self.pool.release(model, keep_alive)
        if self.metrics is not None:
            self.metrics.prompt(model.label, answer["usage"]["prompt_tokens"])
        if self.state.on_request is not None:
            self.state.on_request(
                f"{request.method} {request.url.path} 200 · {answer['usage']['prompt_tokens']} "
                f"tokens · {time.perf_counter() - received:.2f} s"
            )
        return JsonResponse(answer)

    def _model_waits(self) -> anyio.CapacityLimiter:
        """The threads that requests wait on for a model to load or for room to load it, apart
        from the worker threads every request's parsing and every stream's end need: waiters
        that took those would keep a finishing stream from releasing the model they wait for.
        As many as connections may be open, so no waiter queues behind another."""
        if self._waiting_limiter is None:  # made on the event loop, as anyio requires
            self._waiting_limiter = anyio.CapacityLimiter(self.limits.max_connections)
        return self._waiting_limiter

    def _parse(self, body: dict, model: PooledModel, api: GenerationApi) -> ServedRequest:
        return api.parse(body, self._generating_engine(model), self.state.limits)

    @staticmethod
    def _generating_engine(model: PooledModel) -> Engine:
        """The engine of an acquired model that generates text; an embedding model refused."""
        scheduler = model.scheduler
        assert scheduler is not None  # acquired: loaded until released
        if isinstance(scheduler, EmbeddingScheduler):
            message = (
                f"{model.label} is an {scheduler.engine.kind} model: it does not generate text; "
                f"use {'/v1/embeddings' if scheduler.engine.kind == 'embedding' else '/v1/rerank'}"
            )
            raise bad_request(message, "model", "wrong_model_kind")
        return scheduler.engine

    def _submit(self, model: PooledModel, served: ServedRequest) -> ServedRequest:
        served.events = LoopEvents()  # type: ignore[assignment]
        scheduler = model.scheduler
        assert isinstance(scheduler, BatchScheduler)  # _parse refused an embedding model
        try:
            if self.draining or not scheduler.alive:
                raise SchedulerStoppedError(scheduler.stopped_reason)
            scheduler.submit(served)
        except (QueueFullError, SchedulerStoppedError) as error:
            raise self._scheduler_refusal(model, error) from None
        return served

    def _scheduler_refusal(self, model: PooledModel, error: Exception) -> ApiError:
        """What a request a scheduler refused gets: 429 while its queue is full, 503 once it
        has stopped (retry where the pool loads the model again)."""
        if isinstance(error, QueueFullError):
            return ApiError(HTTPStatus.TOO_MANY_REQUESTS, str(error), "queue_full")
        self._refuse_if_unavailable()
        again = "retry: the next request loads it again"
        advice = again if self.pool.reloadable(model.label) else "restart quill serve"
        message = f"{error}; {advice}"
        return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, message, "scheduler_stopped")

    def _refuse_if_unavailable(self) -> None:
        if self.draining:
            message = "the server is shutting down; retry against another instance"
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, message, "server_shutting_down")

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it passes the body limit, and (408) if it has not
        all arrived within the body timeout, whether it has a Content-Length or is chunked."""
        limit = self.state.limits.max_body_bytes
        declared = request.headers.get("content-length")
        too_large = ApiError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the body has {declared or 'more than ' + str(limit)} bytes; this server takes at "
            f"most {limit}",
        )
        if declared is not None and int(declared) > limit:  # h11 has checked it is digits
            raise too_large
        timeout = self.limits.body_timeout_s
        chunks: list[bytes] = []
        size = 0
        try:
            with anyio.fail_after(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            message = f"the body did not all arrive within {timeout:g} s ({size} bytes came)"
            raise ApiError(HTTPStatus.REQUEST_TIMEOUT, message, "body_timeout") from None
        return b"".join(chunks)

    async def _gather(self, request: Request, events: LoopEvents) -> list[StreamEvent] | None:
        """The events of a reply that is not streamed; None if the client left first."""

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            events.put_nowait(DISCONNECTED)

        watcher = asyncio.ensure_future(watch_disconnect())
        pieces: list[StreamEvent] = []
        try:
            while not pieces or pieces[-1].finish_reason is None:
                item = await events.get()
                if item is DISCONNECTED:
                    return None
                if isinstance(item, BaseException):  # a failure, or the drain's ApiError
                    error = _request_failed(item)
                    events.outcome = str(error.status)
                    raise error
                if isinstance(item, PromptProgress):  # asked for by streams only
                    continue
                events.took(item)
                pieces.append(item)
        finally:
            watcher.cancel()
        events.outcome = "200"
        return pieces

    async def _stream(self, queues: list[LoopEvents], replies: list[ReplyFormat], received: float):
        """The frames of a stream, its choices' interleaved as their events come; OpenAI's
        [DONE] once, when every choice has finished."""
        merged: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def forward(index: int, events: LoopEvents) -> None:
            while True:
                item = await events.get()
                await merged.put((index, item))
                finished = isinstance(item, StreamEvent) and item.finish_reason is not None
                if finished or isinstance(item, BaseException):
                    return

        forwarders = [asyncio.ensure_future(forward(i, q)) for i, q in enumerate(queues)]
        try:
            for reply in replies:
                for frame in reply.opening():
                    yield frame
            first_at = [0.0] * len(queues)  # when each choice's first event came
            done, said_done = 0, False
            while done < len(queues):
                index, item = await merged.get()
                events = queues[index]
                if isinstance(item, BaseException):  # a failure, or the drain's ApiError
                    error = _request_failed(item)
                    for one in queues:
                        one.outcome = f"200, then {error.status}"
                    yield replies[index].failure(error.body())
                    return
                if isinstance(item, PromptProgress):
                    for frame in replies[index].progress(item):
                        yield frame
                    continue
                events.took(item)
                first_at[index] = first_at[index] or time.perf_counter()
                queued_s = (first_at[index] - received) - item.prefill_s
                for frame in replies[index].frames(item, queued_s):
                    if frame == ReplyWriter.DONE:
                        said_done = True  # held until every choice is done
                    else:
                        yield frame
                if item.finish_reason is not None:
                    events.outcome = "200"
                    done += 1
            if said_done:
                yield ReplyWriter.DONE
        finally:
            for forwarder in forwarders:
                forwarder.cancel()

    def begin_drain(self) -> None:
        """Refuse new requests; after the drain timeout, end those still in flight."""
        if self.draining:
            return
        self.draining = True
        self.pool.drain()
        asyncio.get_running_loop().call_later(
            streams_end_after(self.limits.drain_timeout_s), self._end_in_flight
        )

    def _end_in_flight(self) -> None:
        message = "the server shut down before this reply was finished"
        for events in list(self.in_flight):
            events.put_nowait(
                ApiError(HTTPStatus.SERVICE_UNAVAILABLE, message, "server_shutting_down")
            )


def streams_end_after(drain_timeout_s: float) -> float:
    """When, after SIGTERM, requests still in flight are ended: the drain timeout bounds the
    whole shutdown (a supervisor kills a process that outlives its grace period), so the last
    second of it, or the last fifth of a short one, is kept for closing streams and freeing the
    model."""
    return max(0.0, drain_timeout_s - min(1.0, drain_timeout_s / 5))


def _keep_alive(body: dict) -> float | None:
    """Ollama's keep_alive field: how long the model stays loaded after this request."""
    if body.get("keep_alive") is None:
        return None
    try:
        return parse_duration(body["keep_alive"])
    except ValueError as error:
        raise bad_request(f"'keep_alive': {error}", "keep_alive") from None


EMBEDDING_PATHS = ("/v1/embeddings", "/embeddings")
RERANK_PATHS = ("/v1/rerank", "/rerank", "/reranking", "/v1/reranking")
ErrorShape = Callable[[ApiError], dict[str, Any]]


def input_tokens(api: GenerationApi) -> EngineAnswer:
    """The prompt tokens a request to api would prefill, counted without generating (OpenAI's
    POST /v1/responses/input_tokens; llama-server's /chat/completions/input_tokens)."""

    def answer(body: dict, engine: Engine, limits: ServerLimits) -> dict[str, Any]:
        served = api.parse({**body, "stream": False}, engine, limits)
        return {"object": "response.input_tokens", "input_tokens": len(served.prompt_tokens)}

    return answer


def _version(package: str) -> str:
    """A package's installed version (quill's own is cli.__version__, as `quill --version`'s)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def error_shape(path: str) -> ErrorShape | None:
    """How errors on path are written when not as OpenAI's: Anthropic's on its routes."""
    from cli.api.anthropic import anthropic_error

    return anthropic_error if path.startswith("/v1/messages") else None


def _error_read_back(status: int, text: bytes) -> ApiError:
    """An error response's body (an OpenAI error object, or text starlette wrote) as an
    ApiError, to be written again in another shape."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        error = json.loads(text)["error"]
        return ApiError(status, error["message"], error.get("code"), error.get("param"))
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
    return ApiError(status, text.decode("utf-8", "replace").strip() or phrase or f"HTTP {status}")


def _path_of(request_start: bytes) -> str:
    """The path of a request line ("POST /v1/messages HTTP/1.1"), or "" where there is none."""
    parts = request_start.split(b"\r\n", 1)[0].split(b" ")
    return parts[1].decode("latin-1") if len(parts) == 3 else ""


def _loop_events(served: ServedRequest) -> LoopEvents:
    events = served.events
    assert isinstance(events, LoopEvents)  # _submit gave it one
    return events


def _route_of(path: str) -> str:
    """A request's route for /metrics' label: its path where a route has it, else "other"
    (a label per path a client invents would grow the metrics without bound)."""
    if path in ROUTE_METHODS:
        return path
    return "/v1/responses/{id}" if path.startswith("/v1/responses/") else "other"


def _no_route(path: str) -> ApiError:
    return ApiError(HTTPStatus.NOT_FOUND, f"no route {path}")


def _request_failed(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, (UsageError, InvalidOutputError)):  # the request's grammar, say
        return ApiError(HTTPStatus.BAD_REQUEST, str(error))
    return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, f"the server failed on this request: {error}")


def _host_name(host: str) -> str:
    """The name in a Host header, without its port: 'localhost:8080' -> 'localhost',
    '[::1]:8080' -> '::1'."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the application when shutdown begins."""

    def __init__(self, config: uvicorn.Config, app: DrainingApp) -> None:
        super().__init__(config)
        self.quill_app = app  # config.app, typed: uvicorn's Config takes any ASGI app

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.quill_app.begin_drain()
        await super().shutdown(sockets)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the server starts, so that a port in use is one
    error line and the bound port is known."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


def allowed_hosts_for(hosts: list[str]) -> tuple[str, ...] | None:
    """The Host names a server bound to loopback addresses only answers to; None: any."""
    return tuple(dict.fromkeys((*LOOPBACK_NAMES, *hosts))) if all(map(is_loopback, hosts)) else None


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# llama-server's --cors-origins keyword: any port of this machine's loopback names.
LOCALHOST_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


class DrainingApp(Protocol):
    """An ASGI application told when the server begins to shut down."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None: ...
    def begin_drain(self) -> None: ...


def run_server(
    socks: list[socket.socket], app: DrainingApp, limits: HttpLimits, verbose: bool = False
) -> str | None:
    """Serve app (a QuillApp, or serve --rpc's proxy) until SIGTERM or SIGINT, drain, return
    the signal's name (None if none came)."""
    _quiet_logs(verbose)
    config = uvicorn.Config(
        app,
        loop="asyncio",
        http=make_protocol(limits),
        ws="none",
        lifespan="off",
        interface="asgi3",
        log_config=None,
        access_log=False,
        server_header=False,
        headers=[("server", "quill")],
        backlog=LISTEN_BACKLOG,
        timeout_keep_alive=KEEP_ALIVE_S,
        # A backstop only: the application ends in-flight requests at the drain timeout.
        timeout_graceful_shutdown=int(limits.drain_timeout_s) + 5,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    server = DrainingServer(config, app)
    received: list[str] = []

    def note(number: int, _frame: object) -> None:
        received.append(signal.Signals(number).name)

    # uvicorn re-raises the signal that stopped it once it has shut down; these handlers take
    # it, so that a drained server exits 0 instead of dying of the signal.
    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=socks)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return received[0] if received else None


class _OneLine(logging.Formatter):
    def __init__(self, verbose: bool) -> None:
        super().__init__("quill serve: %(message)s")
        self.verbose = verbose

    def format(self, record: logging.LogRecord) -> str:
        if not self.verbose and record.exc_info:
            record = logging.makeLogRecord(
                {**record.__dict__, "msg": f"{record.getMessage()} ({record.exc_info[1]!r})",
                 "args": None, "exc_info": None, "exc_text": None}
            )  # fmt: skip
        return super().format(record)


def _quiet_logs(verbose: bool) -> None:
    """uvicorn's and asyncio's logs: one line each on stderr, warnings and worse only (all of
    them when verbose), never a traceback unless verbose."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLine(verbose))
    for name in ("uvicorn", "asyncio", "quill.serve"):
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.propagate = False
        logger.setLevel(logging.INFO if verbose else logging.ERROR)
    logging.getLogger("quill.serve").setLevel(logging.INFO if verbose else logging.WARNING)

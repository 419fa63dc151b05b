"""Any OpenAI-compatible server as a source of StreamEvents: quill serve, llama-server, vLLM,
Ollama's /v1. TTFT and tokens/s come from when each Server-Sent Event arrives here, so they are
what this client saw, queueing and network included; token counts come from the server's usage.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from cli.engine.events import Candidate, StreamEvent, TokenLogprobs
from cli.engine.sampling import SamplingParams
from cli.errors import (
    AuthRequiredError,
    EndpointError,
    MissingEndpointError,
    ModelNotFoundError,
    NotOursError,
    QuillError,
    UsageError,
)


@dataclass
class RemoteModel:
    """A model behind an OpenAI-compatible server, as a Backend."""

    url: str
    model: str
    api_key: str | None = None
    logprobs: int | None = None  # ask the server for logprobs with this many alternatives
    # What a local engine reports of itself: the server keeps its own load, window, KV cache,
    # threads, prompt cache and speculation, and says nothing of them.
    manages_window = samples_here = reports_runtime = False
    has_chat_template = True  # the server applies its own
    load_s = restore_s = 0.0
    n_ctx = kv_cache_bytes = threads = gpu_layers = cached_tokens = restored_tokens = 0
    kv_type_k = kv_type_v = core_load = prompt_cache = speculation_stats = None
    rpc: tuple[str, ...] = ()
    weights_placement = ""

    @property
    def location(self) -> str:
        return self.url

    @property
    def server_url(self) -> str:
        return self.url

    def count_tokens(self, messages: Sequence[tuple[str, str]]) -> int | None:
        return None  # the server checks its own window

    def stream_chat(
        self,
        messages: Sequence[tuple[str, str]] | str,
        max_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str] = (),
    ) -> Iterator[StreamEvent]:
        return stream_chat(
            self.url,
            messages,
            self.model,
            max_tokens,
            sampling,
            stop,
            self.api_key,
            logprobs=self.logprobs,
        )

    stream_text = stream_chat  # a text goes as it is to /v1/completions: no chat template

    def perf_note(self) -> str:
        return ""

    def keep_prompt_cache(self, always: bool = False) -> None:
        pass

    def clear_cache(self) -> None:
        pass

    def set_threads(self, threads: int | None) -> None:
        raise NotOursError(f"the server at {self.url} chooses its own threads")

    def close(self) -> None:
        pass


def _root(base: str) -> str:
    """The server's /v1 URL, from what the user gave: it, the server, or its chat URL."""
    base = base.rstrip("/")
    if base.endswith("/chat/completions"):
        return base.removesuffix("/chat/completions")
    return base if base.endswith("/v1") else base + "/v1"


def first_model(base_url: str, api_key: str | None, timeout_s: float = 10) -> str | None:
    """The first model GET /v1/models lists: what to ask for when the user names none."""
    try:
        listed = _json(_root(base_url) + "/models", api_key, timeout_s=timeout_s).get("data") or []
    except ValueError:
        return None
    return listed[0].get("id") if listed and isinstance(listed[0], dict) else None


def stream_chat(
    base_url: str,
    messages: Sequence[tuple[str, str]] | str,
    model: str | None,
    max_tokens: int,
    sampling: SamplingParams,
    stop: Sequence[str] = (),
    api_key: str | None = None,
    timeout_s: float = 600,
    logprobs: int | None = None,
    cache_prompt: bool = True,
) -> Iterator[StreamEvent]:
    """Send the request now (a refusal or an unreachable server raises here, before any reply),
    and return the events of the reply as they arrive. messages: a conversation, to
    /v1/chat/completions; or a text, sent as it is to /v1/completions (MissingEndpointError
    where the server has no such route). cache_prompt=False asks the server (llama-server's and
    quill serve's extension) to prefill the whole prompt."""
    body: dict[str, Any] = {
        "model": model or first_model(base_url, api_key) or "default",
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        # Extensions that llama-server, vLLM and quill serve accept, so sampling matches local runs.
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "repeat_penalty": sampling.repeat_penalty,
        "stop": list(stop) or None,
        "stream_options": {"include_usage": True},
    }
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.ignore_eos:
        body["ignore_eos"] = True
    if sampling.grammar:  # llama-server's field, which quill serve takes too
        body["grammar"] = sampling.grammar
    if not cache_prompt:
        body["cache_prompt"] = False
    if isinstance(messages, str):
        url = _root(base_url) + "/completions"
        body["prompt"] = messages
        if logprobs is not None:
            body["logprobs"] = logprobs  # the legacy field: the number of alternatives
    else:
        url = _root(base_url) + "/chat/completions"
        body["messages"] = [{"role": role, "content": text} for role, text in messages]
        if logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, logprobs
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    started = time.perf_counter()
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except OSError as error:
        raise _failure(url, error) from None
    return _events(response, started, sampling, logprobs is not None)


def _events(
    response: Any, started: float, sampling: SamplingParams, logprobs: bool = False
) -> Iterator[StreamEvent]:
    """One event per content chunk of the SSE stream, then the last with the server's usage;
    with logprobs, each event carries the entries that came since the last one."""
    first_at: float | None = None
    generated = 0
    finish: str | None = None
    usage: dict = {}
    timings: dict = {}
    entries: list[TokenLogprobs] = []
    with response:
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") if isinstance(chunk.get("timings"), dict) else timings
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                text = delta.get("content") or choice.get("text") or ""
                # DeepSeek's API, llama-server and quill serve send reasoning apart.
                reasoning = delta.get("reasoning_content") or ""
                finish = choice.get("finish_reason") or finish
                entries += _entries(choice.get("logprobs")) if logprobs else []
                if not text and not reasoning:
                    continue
                now = time.perf_counter()
                generated += 1
                first_at = first_at or now
                yield _event(
                    text,
                    generated,
                    first_at - started,
                    now - first_at,
                    reasoning=reasoning,
                    thinking=bool(reasoning),
                    logprobs=tuple(entries) if logprobs else None,
                )
                entries = []
    now = time.perf_counter()
    ttft = (first_at or now) - started  # as the client saw it: queueing and the network included
    yield _event(
        "",
        int(usage.get("completion_tokens") or generated),
        ttft,
        now - (first_at or now),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_prompt_tokens=_cached_tokens(usage),
        restored_prompt_tokens=_count(timings.get("cache_disk_n")),
        finish_reason=finish or "stop",
        seed=sampling.seed if sampling.seed is not None else -1,
        logprobs=tuple(entries) if logprobs else None,
    )


def _entries(logprobs: Any) -> list[TokenLogprobs]:
    """A chunk's choice.logprobs as entries (the server does not say the token ids): chat's
    content list, or completions' parallel lists; what is shaped as neither is skipped."""
    if not isinstance(logprobs, dict):
        return []
    content = logprobs.get("content")
    if isinstance(logprobs.get("tokens"), list):
        content = _legacy_content(logprobs)
    entries = []
    for item in content if isinstance(content, list) else []:
        chosen = _candidate(item)
        if chosen is None:
            continue
        top = item.get("top_logprobs") if isinstance(item.get("top_logprobs"), list) else []
        alternatives = tuple(c for c in map(_candidate, top) if c is not None)
        entries.append(TokenLogprobs(chosen, alternatives))
    return entries


def _legacy_content(logprobs: dict) -> list[dict[str, Any]]:
    """/v1/completions' logprobs (tokens, token_logprobs and top_logprobs, a map of token to
    logprob per token, side by side) as chat's content list."""
    values, tops = logprobs.get("token_logprobs") or [], logprobs.get("top_logprobs") or []
    content = []
    for index, (token, value) in enumerate(zip(logprobs["tokens"], values, strict=False)):
        top = tops[index] if index < len(tops) and isinstance(tops[index], dict) else {}
        alternatives = [{"token": t, "logprob": v} for t, v in top.items()]
        content.append({"token": token, "logprob": value, "top_logprobs": alternatives})
    return content


def _candidate(item: Any) -> Candidate | None:
    if not isinstance(item, dict) or not isinstance(item.get("logprob"), (int, float)):
        return None
    token = item.get("token")
    if not isinstance(token, str):
        token = ""
    raw = item.get("bytes")
    if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
        piece = bytes(raw)
    else:
        piece = token.encode("utf-8", "replace")
    return Candidate(-1, piece, float(item["logprob"]))


def _event(text: str, generated: int, ttft: float, decode_s: float, **more: Any) -> StreamEvent:
    """A content chunk as an event (the server does not say which token), or, with
    finish_reason in more, the last event, carrying the server's usage counts."""
    more = {
        "prompt_tokens": 0,
        "cached_prompt_tokens": 0,
        "finish_reason": None,
        "seed": -1,
        **more,
    }
    return StreamEvent(
        text=text,
        token=-1 if more["finish_reason"] is None else None,
        prefill_s=ttft,
        generation_tokens=generated,
        decode_s=decode_s,
        stop_string=None,
        peak_rss_bytes=0,
        **more,
    )


def _cached_tokens(usage: dict) -> int:
    """OpenAI's usage.prompt_tokens_details.cached_tokens, where the server reports it."""
    details = usage.get("prompt_tokens_details")
    return _count(details.get("cached_tokens") if isinstance(details, dict) else None)


def _count(value: object) -> int:
    """A token count a server sent, or 0 where it sent none (or something else)."""
    return value if type(value) is int and value >= 0 else 0


def _failure(url: str, error: OSError) -> QuillError:
    """The error for a server that refused (by its status and message) or could not be reached."""
    if not isinstance(error, urllib.error.HTTPError):
        reason = getattr(error, "reason", error)
        return EndpointError(f"cannot reach {url}: {reason}; is the server running?")
    try:
        message = json.loads(error.read())["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = error.reason
    text = f"{url} answered {error.code}: {message}"
    if error.code == 401:
        return AuthRequiredError(text)
    if error.code == 404 and "model" not in str(message).lower():
        return MissingEndpointError(url, str(message))
    if error.code == 404:
        return ModelNotFoundError(text)
    if error.code in (400, 413, 422):
        return UsageError(text)
    return EndpointError(text)


def server_json(
    base_url: str, path: str, api_key: str | None, body: dict | None = None, timeout_s: float = 30
) -> dict:
    """A JSON answer from a path at the server's root (GET, or POST of body): /api/ps,
    /models/unload."""
    url = _root(base_url).removesuffix("/v1") + path
    try:
        return _json(url, api_key, body, timeout_s)
    except ValueError:
        raise EndpointError(f"{url} answered something that is not JSON") from None


def _json(url: str, api_key: str | None, body: dict | None = None, timeout_s: float = 30) -> Any:
    """What url answers, parsed (GET, or POST of body): a failed request is mapped once to an
    error (_failure); an answer that is not JSON is left to the caller (ValueError)."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        request = urllib.request.Request(url, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except OSError as error:
        raise _failure(url, error) from None

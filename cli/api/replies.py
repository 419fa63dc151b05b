"""A reply in OpenAI's wire format: ChatReply splits a chat reply into reasoning_content (as
DeepSeek's API and llama-server send it), content and tool_calls; ReplyWriter makes the JSON
bodies and Server-Sent Events of replies, logprobs included.
"""

from __future__ import annotations

import codecs
import json
import re
import time
from collections.abc import Iterable
from typing import Any

from cli.engine.events import Candidate, PromptProgress, StreamEvent, TokenLogprobs
from cli.engine.reasoning import ReasoningSplitter, prompt_opens_thinking
from cli.engine.toolcalls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    ToolCall,
    may_start_call,
    parse_tool_calls,
)

_BLOCK = re.compile(re.escape(HERMES_OPEN) + r".*?" + re.escape(HERMES_CLOSE), re.S)


class ChatReply:
    """Fed the raw text of each event: the deltas a stream sends, and the message of a whole
    reply. While tools are offered, text that may start a call is held back; each call goes out
    whole, as one tool_calls delta: a Hermes/Qwen <tool_call> block as soon as it closes, the
    formats that are one JSON value when the reply ends."""

    def __init__(self, prompt: str, tools: list[dict] | None, call_format: str) -> None:
        self.splitter = ReasoningSplitter(prompt_opens_thinking(prompt))
        self.tools = tools
        self.call_format = call_format
        self.reasoning = ""
        self.answer = ""
        self.sent = 0  # characters of answer already sent as content
        self.calls: list[ToolCall] = []
        self.content: str | None = None  # the final content, once finished
        self.scanned = 0  # characters of answer already searched for complete calls

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas this piece of text releases."""
        reasoning, answer = self.splitter.push(text)
        if finished:
            more_reasoning, more_answer = self.splitter.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        deltas: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        self.reasoning += reasoning
        self.answer += answer
        if self.tools and self.call_format == "hermes":
            deltas += self._completed_blocks()
        if self.calls:  # calls went out as they closed: after them nothing is content
            if finished:
                _, more = parse_tool_calls(self.answer[self.scanned :], "hermes")
                deltas += [self._calls_delta(more)] if more else []
            return deltas
        safe = may_start_call(self.answer) if self.tools else len(self.answer)
        calls: list[ToolCall] = []
        if finished:
            safe = len(self.answer)
            if self.tools:
                content, calls = parse_tool_calls(self.answer, self.call_format)
                if calls:  # what went out already (it looked like content) stays sent
                    safe = max(min(len(content), safe), self.sent)
            self.content = self.answer[:safe] if calls else self.answer
        if safe > self.sent:
            deltas.append({"content": self.answer[self.sent : safe]})
            self.sent = safe
        return [*deltas, self._calls_delta(calls)] if calls else deltas

    def _completed_blocks(self) -> list[dict[str, Any]]:
        """Each <tool_call> block whose closing tag has come, as a tool_calls delta (a Hermes
        block closes before the reply ends: the client need not wait), after the content
        before the first one."""
        deltas: list[dict[str, Any]] = []
        while match := _BLOCK.search(self.answer, self.scanned):
            _, calls = parse_tool_calls(match.group(0), "hermes")
            if not calls:
                break  # not a call that parses: the end decides
            if not self.calls:
                self.content = self.answer[: match.start()].strip()
                head = len(self.answer[: match.start()].rstrip())
                if head > self.sent:
                    deltas.append({"content": self.answer[self.sent : head]})
            deltas.append(self._calls_delta(calls))
            self.scanned = self.sent = match.end()
        return deltas

    def _calls_delta(self, calls: list[ToolCall]) -> dict[str, Any]:
        """A tool_calls delta, numbered on from the calls sent before."""
        first = len(self.calls)
        self.calls.extend(calls)
        return {"tool_calls": [call.as_openai(first + i) for i, call in enumerate(calls)]}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls else reason

    def message(self) -> dict[str, Any]:
        """The assistant message of a whole (not streamed) reply."""
        content = self.content if self.content is not None else self.answer
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["content"] = content or None
            message["tool_calls"] = [call.as_openai() for call in self.calls]
        return message


def _candidate(candidate: Candidate) -> dict[str, Any]:
    return {"token": candidate.text, "logprob": candidate.logprob, "bytes": list(candidate.piece)}


def chat_logprob(entry: TokenLogprobs) -> dict[str, Any]:
    """One token of OpenAI's chat logprobs.content: its text (U+FFFD where it ends inside a
    character; its bytes are exact), logprob, bytes, and the most likely tokens at its step."""
    return {**_candidate(entry.chosen), "top_logprobs": [_candidate(c) for c in entry.top]}


class CompletionLogprobs:
    """The legacy logprobs object of /v1/completions, chunk by chunk: tokens, token_logprobs,
    top_logprobs (per token, text to logprob of the N most likely and the chosen one, as OpenAI
    gives up to logprobs+1) and text_offset, counted on across the chunks of a stream."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0

    def shape(self, entries: Iterable[TokenLogprobs]) -> dict[str, Any]:
        shaped: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }  # fmt: skip
        for entry in entries:
            top: dict[str, float] = {}
            for candidate in (*entry.top, entry.chosen):  # two tokens of one text: the likelier
                top.setdefault(candidate.text, candidate.logprob)
            shaped["tokens"].append(entry.chosen.text)
            shaped["token_logprobs"].append(entry.chosen.logprob)
            shaped["top_logprobs"].append(top)
            shaped["text_offset"].append(self._offset)
            self._offset += len(self._decoder.decode(entry.chosen.piece))
        return shaped


class ReplyWriter:
    """One reply in OpenAI's wire format: whole, or as the chunks of a stream (chat's first
    carries the role, then one per piece of text, the last finish_reason, usage and timings).

    A streamed chunk carries the logprobs entries released since the previous chunk: an event
    whose text is all held back (by the reply shaper too) adds its entries to a later chunk."""

    DONE = b"data: [DONE]\n\n"

    def __init__(
        self,
        ident: str,
        model_name: str,
        reply: ChatReply | None,
        index: int = 0,
        usage_chunk: bool = False,
    ) -> None:
        self.reply = reply  # None: /v1/completions
        self.index = index  # the choice's, of a request's n
        # stream_options.include_usage: usage and timings in a chunk of their own after the
        # last, with no choices, as OpenAI sends them (else on the last chunk, as before)
        self.usage_chunk = usage_chunk
        self.chat = reply is not None
        self._held: list[TokenLogprobs] = []
        self._legacy = CompletionLogprobs()
        self.base = {"id": ident, "object": "", "created": int(time.time()), "model": model_name}

    def chunk(
        self, delta: str | dict | None, finish: str | None = None, first: bool = False
    ) -> dict[str, Any]:
        """A streamed chunk: delta is text, or chat's reasoning_content, content or tool_calls."""
        if self.chat:
            content: dict[str, Any] = {"role": "assistant"} if first else {}
            if isinstance(delta, dict):
                content.update(delta)
            elif delta is not None:
                content["content"] = delta
            choice = {"index": self.index, "delta": content, "finish_reason": finish}
        else:
            choice = {"index": self.index, "text": delta or "", "finish_reason": finish}
        held, self._held = self._held, []
        choice["logprobs"] = self._logprobs(held or None)
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self.base, "object": kind, "choices": [choice]}

    def chunks(self, event: StreamEvent, queued_s: float) -> list[dict[str, Any]]:
        """The chunks an event of the stream releases; the last event's end with the final one."""
        self._held.extend(event.logprobs or ())
        finished = event.finish_reason is not None
        if self.reply is not None:
            chunks = [self.chunk(delta) for delta in self.reply.feed(event.text, finished)]
        else:
            chunks = [self.chunk(event.text)] if event.text else []
        if finished:
            final = self.chunk(None if self.chat else "", self._finish_reason(event))
            totals = self._totals(event, queued_s)
            if self.usage_chunk:
                kind = final["object"]
                chunks += [final, {**self.base, "object": kind, "choices": [], **totals}]
            else:
                chunks.append({**final, **totals})
        return chunks

    def whole(self, events: list[StreamEvent], queued_s: float) -> dict[str, Any]:
        """The body of a reply that was not streamed."""
        last, text = events[-1], "".join(event.text for event in events)
        asked = [event.logprobs for event in events if event.logprobs is not None]
        entries = [entry for some in asked for entry in some] if asked else None
        choice: dict[str, Any] = {"index": self.index, "logprobs": self._logprobs(entries)}
        if self.reply is not None:
            self.reply.feed(text, finished=True)
            choice["message"] = self.reply.message()
        else:
            choice["text"] = text
        choice["finish_reason"] = self._finish_reason(last)
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.base, "object": kind, "choices": [choice], **self._totals(last, queued_s)}

    def opening(self) -> list[bytes]:
        """The frames a stream begins with, before the first event: chat's role chunk."""
        return [sse(self.chunk("", first=True))] if self.chat else []

    def frames(self, event: StreamEvent, queued_s: float) -> list[bytes]:
        """The frames an event of the stream releases; the last event's end with [DONE]."""
        frames = [sse(chunk) for chunk in self.chunks(event, queued_s)]
        return [*frames, self.DONE] if event.finish_reason is not None else frames

    def failure(self, error: dict[str, Any]) -> bytes:
        """The frame that ends a stream which failed after it began (error: its error body)."""
        return sse(error)

    def progress(self, progress: PromptProgress) -> list[bytes]:
        """A chunk with nothing generated, and llama-server's prompt_progress."""
        return [sse({**self.chunk(None), "prompt_progress": progress_json(progress)})]

    def _finish_reason(self, last: StreamEvent) -> str | None:
        return self.reply.finish_reason(last.finish_reason) if self.reply else last.finish_reason

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [chat_logprob(entry) for entry in entries], "refusal": None}
        return self._legacy.shape(entries)

    @staticmethod
    def _totals(last: StreamEvent, queued_s: float) -> dict[str, Any]:
        """OpenAI's usage, and llama-server's timings plus TTFT."""
        return {
            "usage": {
                "prompt_tokens": last.prompt_tokens,
                "completion_tokens": last.generation_tokens,
                "total_tokens": last.prompt_tokens + last.generation_tokens,
                "prompt_tokens_details": {"cached_tokens": last.cached_prompt_tokens},
            },
            "timings": {
                **timings(last),
                "ttft_ms": (max(queued_s, 0.0) + last.prefill_s) * 1000,
            },
        }


def merged_choices(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole replies of a request's n choices as one: every choice, the prompt counted
    once and the completions summed, as OpenAI's usage counts them."""
    first = bodies[0]
    if len(bodies) == 1:
        return first
    completion = sum(body["usage"]["completion_tokens"] for body in bodies)
    prompt = first["usage"]["prompt_tokens"]
    usage = {**first["usage"], "completion_tokens": completion, "total_tokens": prompt + completion}
    choices = [choice for body in bodies for choice in body["choices"]]
    return {**first, "choices": choices, "usage": usage}


def timings(last: StreamEvent) -> dict[str, float]:
    """llama-server's timings of a reply so far: cache_n counts the prompt tokens reused
    (cache_memory_n from a slot or a parked cache, cache_disk_n from the KV store), prompt_n
    those prefilled; the generation's rates are over its decode steps (the first token comes
    from the prefill's logits); 0 where nothing was measured, so that every value is finite."""
    prompt_n = last.prompt_tokens - last.cached_prompt_tokens
    return {
        "cache_n": last.cached_prompt_tokens,
        "cache_memory_n": last.cached_prompt_tokens - last.restored_prompt_tokens,
        "cache_disk_n": last.restored_prompt_tokens,
        **_rates("prompt", prompt_n, prompt_n, last.prefill_s),
        **_rates("predicted", last.generation_tokens, last.generation_tokens - 1, last.decode_s),
    }


def progress_timings(progress: PromptProgress) -> dict[str, float]:
    """The timings of a request still prefilling: nothing generated yet."""
    prompt_n = progress.processed - progress.cached
    return {
        "cache_n": progress.cached,
        **_rates("prompt", prompt_n, prompt_n, progress.elapsed_s),
        **_rates("predicted", 0, 0, 0.0),
    }


def _rates(name: str, count: int, steps: int, seconds: float) -> dict[str, float]:
    ms = max(seconds, 0.0) * 1000
    return {
        f"{name}_n": count,
        f"{name}_ms": ms,
        f"{name}_per_token_ms": ms / steps if ms > 0 and steps > 0 else 0.0,
        f"{name}_per_second": steps * 1000 / ms if ms > 0 and steps > 0 else 0.0,
    }


def progress_json(progress: PromptProgress) -> dict[str, Any]:
    """llama-server's prompt_progress object."""
    return {
        "total": progress.total,
        "cache": progress.cached,
        "processed": progress.processed,
        "time_ms": progress.elapsed_s * 1000,
    }


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"

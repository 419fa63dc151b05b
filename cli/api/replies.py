"""One chat reply as the OpenAI wire format shapes it: reasoning in reasoning_content (as
DeepSeek's API and llama-server send it), the answer in content, tool calls in tool_calls.

Fed the raw text of each event; gives the deltas a stream sends and the message a whole reply
holds. While tools are offered, text that may be the start of a call is held back; each call is
sent whole, as one tool_calls delta (arguments complete): a Hermes/Qwen <tool_call> block as soon
as it closes, the formats that are one JSON value when the reply ends.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable
from typing import Any

from cli.engine.events import Candidate, StreamEvent, TokenLogprobs
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
        """The deltas this piece of text releases (reasoning, content)."""
        reasoning, answer = self.splitter.push(text)
        if finished:
            more_reasoning, more_answer = self.splitter.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        deltas: list[dict[str, Any]] = []
        if reasoning:
            self.reasoning += reasoning
            deltas.append({"reasoning_content": reasoning})
        self.answer += answer
        if self.tools and self.call_format == "hermes":
            deltas += self._completed_blocks()
        if self.calls:  # calls went out as they closed: after them nothing is content
            if finished:
                _, more = parse_tool_calls(self.answer[self.scanned :], "hermes")
                if more:
                    first = len(self.calls)
                    deltas.append({"tool_calls": [c.as_openai(first + i) for i, c in
                                                  enumerate(more)]})  # fmt: skip
                    self.calls.extend(more)
            return deltas
        safe = may_start_call(self.answer) if self.tools else len(self.answer)
        if finished:
            safe = len(self.answer)
            if self.tools:
                content, self.calls = parse_tool_calls(self.answer, self.call_format)
                safe = min(len(content), len(self.answer)) if self.calls else safe
                if self.calls and self.sent > len(content):
                    safe = self.sent  # sent already (it looked like content): nothing more
            self.content = self.answer[:safe] if self.calls else self.answer
        if safe > self.sent:
            deltas.append({"content": self.answer[self.sent : safe]})
            self.sent = safe
        if finished and self.calls:
            deltas.append({"tool_calls": [c.as_openai(i) for i, c in enumerate(self.calls)]})
        return deltas

    def _completed_blocks(self) -> list[dict[str, Any]]:
        """Each <tool_call> block whose closing tag has come, sent at once as a tool_calls
        delta (Hermes/Qwen: a block closes before the reply ends, so the client need not wait
        for the end); the content before the first one is sent first."""
        deltas: list[dict[str, Any]] = []
        while True:
            match = _BLOCK.search(self.answer, self.scanned)
            if match is None:
                return deltas
            _, calls = parse_tool_calls(match.group(0), "hermes")
            if not calls:
                return deltas  # not a call that parses: the end decides
            if not self.calls:
                self.content = self.answer[: match.start()].strip()
                head = len(self.answer[: match.start()].rstrip())
                if head > self.sent:
                    deltas.append({"content": self.answer[self.sent : head]})
            first = len(self.calls)
            deltas.append({"tool_calls": [c.as_openai(first + i) for i, c in enumerate(calls)]})
            self.calls.extend(calls)
            self.scanned = self.sent = match.end()

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls else reason

    def message(self) -> dict[str, Any]:
        """The assistant message of a whole (not streamed) reply."""
        content = self.content if self.content is not None else self.answer
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if not self.calls:
            message["content"] = content
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [c.as_openai() for c in self.calls]
        return message


def _candidate(candidate: Candidate) -> dict[str, Any]:
    return {
        "token": candidate.text,
        "logprob": candidate.logprob,
        "bytes": list(candidate.piece),
    }


def chat_logprob(entry: TokenLogprobs) -> dict[str, Any]:
    """One token of OpenAI's chat logprobs.content: its text, logprob and UTF-8 bytes (a token
    that ends inside a character shows U+FFFD in its text; its bytes are exact), and the most
    likely tokens at its step."""
    return {**_candidate(entry.chosen), "top_logprobs": [_candidate(c) for c in entry.top]}


def chat_logprobs(entries: Iterable[TokenLogprobs]) -> dict[str, Any]:
    """A chat choice's logprobs object."""
    return {"content": [chat_logprob(entry) for entry in entries], "refusal": None}


def event_logprobs(events: Iterable[StreamEvent]) -> list[TokenLogprobs] | None:
    """The logprobs entries of a whole reply, in order; None where none were asked for."""
    entries: list[TokenLogprobs] | None = None
    for event in events:
        if event.logprobs is not None:
            entries = (entries or []) + list(event.logprobs)
    return entries


class CompletionLogprobs:
    """The legacy logprobs object of /v1/completions, chunk by chunk: tokens, token_logprobs,
    top_logprobs (one object per token, text to logprob: the N most likely and the chosen token,
    as OpenAI's legacy API gives up to logprobs+1) and text_offset, the character where each
    token's text starts in the choice's text, counted on across the chunks of a stream."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._offset = 0

    def shape(self, entries: Iterable[TokenLogprobs]) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top_logprobs: list[dict[str, float]] = []
        text_offset: list[int] = []
        for entry in entries:
            chosen = entry.chosen
            tokens.append(chosen.text)
            token_logprobs.append(chosen.logprob)
            top: dict[str, float] = {}
            for candidate in (*entry.top, chosen):  # two tokens of one text: the likelier
                top.setdefault(candidate.text, candidate.logprob)
            top_logprobs.append(top)
            text_offset.append(self._offset)
            self._offset += len(self._decoder.decode(chosen.piece))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }

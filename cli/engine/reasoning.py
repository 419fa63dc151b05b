"""Reasoning kept apart from the answer: a <think>...</think> block at the start of a reply (or one
the template opened at the end of the prompt, as DeepSeek-R1's does) becomes the events'
`reasoning`, `text` only the answer, split token by token (only a possible tag start is held).
A thinking budget closes an unfinished block: the reply so far and the closing tag become the
prompt of a continuation (the prefix cache keeps everything before it)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator, Iterator, Sequence

from cli.engine.backend import Backend
from cli.engine.events import StreamEvent
from cli.engine.sampling import SamplingParams

# (opening, closing) tags, as the families write them: Qwen3, DeepSeek-R1, SmolLM3, QwQ,
# Phi-4-mini-reasoning use <think>; Mistral's Magistral [THINK].
TAGS: tuple[tuple[str, str], ...] = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))


def prompt_opens_thinking(prompt: str) -> tuple[str, str] | None:
    """The tag pair whose block the prompt's end leaves open (the template began it), or None."""
    tail = prompt.rstrip()
    for opening, closing in TAGS:
        if tail.endswith(opening):
            return opening, closing
    return None


class ReasoningSplitter:
    """Text in, (reasoning, answer) out, piece by piece."""

    def __init__(self, opened: tuple[str, str] | None = None) -> None:
        self.state = "reasoning" if opened else "start"
        self.closing = opened[1] if opened else ""
        self.held = ""
        self.raw = ""  # every piece pushed, tags included: what a continuation must resend
        self.reasoning_text = ""
        self.tag_seen = False  # this push opened or closed a block

    def pushed_thinking(self, was_reasoning: bool) -> bool:
        """Whether the text of the last push counts as thinking (was_reasoning: in_reasoning
        before it): inside a block, or the tag that opened or closed one. Text held at the start
        may still open a block: counted as thinking (a reply that starts like a tag and is not
        one miscounts a token or two)."""
        pending = self.state == "start" and bool(self.held.strip())
        return was_reasoning or self.in_reasoning or self.tag_seen or pending

    def push(self, text: str) -> tuple[str, str]:
        self.raw += text
        self.tag_seen = False
        self.held += text
        reasoning, answer = "", ""
        while self.held:
            if self.state == "start":
                stripped = self.held.lstrip()
                for opening, closing in TAGS:
                    if stripped.startswith(opening):
                        self.state, self.closing, self.tag_seen = "reasoning", closing, True
                        self.held = stripped[len(opening) :]
                        break
                    if opening.startswith(stripped):
                        return reasoning, answer  # may still become a tag: wait
                else:
                    self.state = "answer"
                continue
            if self.state == "reasoning":
                at = self.held.find(self.closing)
                if at >= 0:
                    reasoning += self.held[:at]
                    self.held = self.held[at + len(self.closing) :]
                    self.state, self.tag_seen = "after", True
                    continue
                keep = partial_suffix(self.held, self.closing)
                reasoning += self.held[: len(self.held) - keep]
                self.held = self.held[len(self.held) - keep :]
                break
            if self.state == "after":  # the blank lines between the block and the answer
                self.held = self.held.lstrip()
                if not self.held:
                    break
                self.state = "answer"
                continue
            answer += self.held
            self.held = ""
        self.reasoning_text += reasoning
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is held at the end: an unfinished tag is text of the block it is in."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            self.reasoning_text += held
            return held, ""
        return "", held if self.state != "after" else ""

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a start of tag."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def split_events(
    events: Iterator[StreamEvent], splitter: ReasoningSplitter
) -> Iterator[StreamEvent]:
    """Each event with its text split into reasoning and answer."""
    for event in events:
        was_reasoning = splitter.in_reasoning
        reasoning, answer = splitter.push(event.text)
        if event.finish_reason is not None:
            more_reasoning, more_answer = splitter.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        thinking = splitter.pushed_thinking(was_reasoning)
        yield dataclasses.replace(event, text=answer, reasoning=reasoning, thinking=thinking)


def split_reasoning(events: Iterator[StreamEvent], prompt: str) -> Iterator[StreamEvent]:
    """The events of a reply to prompt, reasoning apart from the answer."""
    return split_events(events, ReasoningSplitter(prompt_opens_thinking(prompt)))


def think_within_budget(
    engine: Backend,
    prompt: str,
    events: Generator[StreamEvent, None, None],
    budget: int,
    max_tokens: int,
    sampling: SamplingParams,
    stop: Sequence[str],
) -> Iterator[StreamEvent]:
    """split_reasoning, but a block still open after `budget` thinking tokens is closed: the
    reply so far and the closing tag are sent back as the prompt of the rest of the reply. The
    events of the rest count on from the first part's tokens and decode time."""
    splitter = ReasoningSplitter(prompt_opens_thinking(prompt))
    thinking_tokens = 0
    last: StreamEvent | None = None
    first_token_at = time.perf_counter()
    for event in split_events(events, splitter):
        if last is None:
            first_token_at = time.perf_counter()
        last = event
        thinking_tokens += event.thinking
        if event.finish_reason is not None or not (
            splitter.in_reasoning and thinking_tokens >= budget
        ):
            yield event
            continue
        # The budget is spent inside the block: end this stream, close the block, go on.
        events.close()
        yield dataclasses.replace(event, finish_reason=None)
        left = max_tokens - event.generation_tokens
        if left <= 0:
            yield dataclasses.replace(event, text="", reasoning="", finish_reason="length")
            return
        closed = prompt + splitter.raw + "\n" + splitter.closing + "\n\n"
        after = ReasoningSplitter()
        after.state = "after"
        for more in split_events(engine.stream_text(closed, left, sampling, stop), after):
            yield dataclasses.replace(
                more,
                thinking=False,
                prompt_tokens=event.prompt_tokens,
                cached_prompt_tokens=event.cached_prompt_tokens,
                prefill_s=event.prefill_s,
                generation_tokens=event.generation_tokens + more.generation_tokens,
                decode_s=time.perf_counter() - first_token_at,
            )
        return


class ReasoningWait:
    """When a grammar holds a reply that may reason first: the block is the model's own (a
    grammar over it would make the model think in JSON, and a block the template opened would
    never close), so the grammar holds only the answer after it, as llama.cpp's lazy grammars do.

    free(piece) is asked with each token the plain chain picked, before the grammar sees it: True
    lets it through unconstrained (blank text, the tags, the reasoning); False means the answer
    has begun and the grammar holds this token and every later one."""

    def __init__(self, prompt_tail: str) -> None:
        self.splitter = ReasoningSplitter(prompt_opens_thinking(prompt_tail))
        if any(prompt_tail.rstrip().endswith(closing) for _, closing in TAGS):
            self.splitter.state = "after"  # the continuation after a thinking budget

    @property
    def holding(self) -> bool:
        """Whether the grammar holds every token from now on."""
        return self.splitter.state == "answer"

    def end(self) -> bool:
        """Whether the end of generation passes unconstrained: inside the block yes (the reply
        then has no answer, which validation reports); elsewhere the grammar decides."""
        if self.splitter.in_reasoning:
            return True
        self.splitter.state = "answer"
        return False

    def free(self, piece: str) -> bool:
        if self.holding:
            return False
        answer = self.splitter.push(piece)[1]
        return self.splitter.tag_seen or not answer  # a token that closes the block is free

"""A conversation over one Backend: history, the context window, what the transcript keeps.

Each turn hands the whole history to Backend.stream_chat; a local engine's prefix cache finds all
but the new message already in the KV cache. The transcript is rewritten (by the Transcripts it
is given) when a message is added and every few tokens of a reply: a killed process loses at
most those.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Generator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from cli.engine.backend import Backend
from cli.engine.events import StreamEvent
from cli.engine.sampling import SamplingParams
from cli.errors import ChatOverflowError, QuillError

OVERFLOW_POLICIES = ("truncate", "error")
SAVE_EVERY_TOKENS = 8


# A reply as it streams: a generator, so that an interrupted reply can be closed.
Turn = Generator["TurnStart | StreamEvent", None, None]


@dataclass
class Message:
    role: str  # "user" or "assistant"
    content: str
    interrupted: bool = False  # a reply stopped by Ctrl-C, kept as far as it got
    finish_reason: str | None = None


@dataclass
class ChatSettings:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 512
    stop: tuple[str, ...] = ()
    on_overflow: str = "truncate"


@dataclass(frozen=True)
class TurnStart:
    """Sent before the reply streams: what the turn costs and what had to go to make it fit."""

    prompt_tokens: int
    dropped_messages: int  # oldest messages removed by the truncate policy for this turn
    max_tokens: int  # the reply's budget: the settings', or what is left of the context


class ChatSession:
    def __init__(
        self,
        backend: Backend,
        model_name: str,
        transcript: Path | None,
        system: str | None = None,
        settings: ChatSettings | None = None,
        given: Collection[str] = (),  # settings chosen for this run: a transcript's do not replace
        *,
        transcripts: Transcripts,
    ) -> None:
        self.backend = backend
        self.transcripts = transcripts
        self.model_name = model_name
        self.transcript = transcript
        self.system = system
        self.settings = settings or ChatSettings()
        self.messages: list[Message] = []
        # Messages the model no longer sees (dropped to fit, or /clear): kept in the transcript.
        self.earlier: list[Message] = []
        # An existing transcript is continued; a file that is not one is refused, not overwritten.
        self.continued = 0  # messages taken over from the transcript
        if transcript is not None and (transcript.exists() or transcript.is_symlink()):
            self._continue(transcript, keep_system=system is not None, given=given)
        self.save()

    def conversation(self) -> list[tuple[str, str]]:
        head = [("system", self.system)] if self.system else []
        return head + [(m.role, m.content) for m in self.messages]

    def prompt_tokens(self) -> int | None:
        """Tokens the conversation takes; None where the backend's server counts them."""
        return self.backend.count_tokens(self.conversation())

    def context_used(self) -> int:
        """KV cells holding this conversation here (prompt and the replies so far)."""
        return self.backend.cached_tokens

    def send(self, text: str) -> Turn:
        """Add a user message and stream the reply: a TurnStart, then the engine's events;
        closing the iterator early (Ctrl-C) keeps the partial reply, marked interrupted."""
        check_text(text)  # before it is kept: one bad message must not break every later save
        self.messages.append(Message("user", text))
        self.save()
        yield from self._reply()

    def retry(self) -> Turn:
        """Drop the last reply and answer the last user message again."""
        while self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
        if not self.messages:
            raise ValueError("there is no message to answer again")
        self.save()
        yield from self._reply()

    def _reply(self) -> Turn:
        settings = self.settings
        counted, dropped = self._fit()  # or raises before a reply is begun
        budget = settings.max_tokens
        if counted is not None:
            budget = min(budget, self.backend.n_ctx - counted)
        try:  # a backend refuses (a server's 4xx, a window overflow) before a reply begins
            events = self.backend.stream_chat(
                self.conversation(), budget, settings.sampling, settings.stop
            )
        except QuillError:
            self.messages.pop()  # the refused message was never answered: it is not kept
            self.save()
            raise
        yield TurnStart(counted or 0, dropped, budget)
        reply = Message("assistant", "", interrupted=True)
        self.messages.append(reply)
        pieces: list[str] = []
        try:
            for event in events:
                pieces.append(event.text)
                reply.content = "".join(pieces)
                if event.finish_reason is not None:
                    reply.interrupted = False
                    reply.finish_reason = event.finish_reason
                elif event.generation_tokens % SAVE_EVERY_TOKENS == 0:
                    self.save()
                yield event
        finally:
            reply.content = "".join(pieces)
            self.save()

    def _fit(self) -> tuple[int | None, int]:
        """Tokens of the next prompt (None where a server checks its own window), and the
        messages dropped to fit it. A drop changes the prompt's start (a full prefill): dropping
        down to half the window, as llama-server does, buys several turns of cache reuse."""
        n_ctx = self.backend.n_ctx
        # Leave room for a useful reply: the requested length, up to a quarter of the window.
        room = min(self.settings.max_tokens, n_ctx // 4)
        limit = n_ctx - room
        tokens = self.prompt_tokens()
        if tokens is None or tokens <= limit:
            return tokens, 0
        if self.settings.on_overflow == "error" and len(self.messages) > 1:
            self.messages.pop()  # the refused message was never answered: it is not kept
            self.save()
            raise ChatOverflowError(tokens, room, n_ctx, whole_conversation=True)
        dropped = 0
        while len(self.messages) > 1 and tokens > min(limit, n_ctx // 2):
            # The oldest exchange goes: a user message and the reply that followed it.
            self.earlier.append(self.messages.pop(0))
            dropped += 1
            while len(self.messages) > 1 and self.messages[0].role != "user":
                self.earlier.append(self.messages.pop(0))
                dropped += 1
            tokens = self.prompt_tokens() or 0
        if tokens > limit:
            self.messages.pop()
            self.save()
            raise ChatOverflowError(tokens, room, n_ctx, whole_conversation=False)
        self.save()
        return tokens, dropped

    def clear(self) -> None:
        """Forget the conversation and the KV cache (the system prompt stays; the transcript
        keeps the messages under "earlier")."""
        self.earlier.extend(self.messages)
        self.messages.clear()
        self.backend.clear_cache()
        self.save()

    def set_system(self, text: str | None) -> None:
        if text:
            check_text(text)
        self.system = text or None
        self.save()

    def as_dict(self) -> dict[str, Any]:
        sampling = asdict(self.settings.sampling)
        return {
            "model": self.model_name,
            "system": self.system,
            "settings": {
                **sampling,
                "max_tokens": self.settings.max_tokens,
                "stop": list(self.settings.stop),
            },
            "messages": [asdict(m) for m in self.messages],
            "earlier": [asdict(m) for m in self.earlier],
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def save(self, path: Path | None = None) -> None:
        target = path or self.transcript
        if target is None:
            return
        self.transcripts.write(target, self.as_dict())

    def load(self, path: Path) -> None:
        """Replace the conversation with a saved one (its system prompt and messages)."""
        data = self.transcripts.read(path, continuing=False)
        self.earlier.extend(self.messages)
        self.messages = data.messages
        self.system = data.system
        self.save()

    def _continue(self, path: Path, keep_system: bool, given: Collection[str]) -> None:
        """Take over the conversation and the settings in an existing transcript file."""
        data = self.transcripts.read(path, continuing=True)
        self.messages, self.earlier = data.messages, data.earlier
        saved = {key: value for key, value in data.settings.items() if key not in given}
        self.settings = with_settings(self.settings, saved)
        if not keep_system:
            self.system = data.system
        self.continued = len(data.messages)


@dataclass(frozen=True)
class SavedConversation:
    system: str | None
    messages: list[Message]
    earlier: list[Message]
    settings: dict[str, Any]  # what /set changes; none in a transcript older than that


class Transcripts(Protocol):
    """Where conversations are kept (cli/store/transcripts.py): the session says what to keep
    and when; how a file is read, checked and replaced is the store's."""

    def read(self, path: Path, continuing: bool) -> SavedConversation: ...

    def write(self, path: Path, data: dict[str, Any]) -> None: ...


def check_text(text: str) -> None:
    """ValueError unless text can be written as UTF-8: bytes that were not UTF-8 arrive from
    stdin as lone surrogates, which would fail every later save of the transcript."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        char = ord(text[error.start])
        what = (
            f"byte 0x{char - 0xDC00:02x}"
            if 0xDC80 <= char <= 0xDCFF
            else f"a lone surrogate U+{char:04X}"
        )
        raise ValueError(
            f"not valid UTF-8 ({what} at character {error.start + 1}); not sent: "
            "send the text in UTF-8"
        ) from None


# What /set accepts, as the command-line options do (llama.cpp's top-k is an int32 and its seeds
# a uint32 whose largest value means "random"); float("inf") and float("nan") fail these too.
SETTING_RANGES: dict[str, tuple[type, float, float]] = {
    "temperature": (float, 0, 1e6),  # "0 means greedy"; past a few it is noise, not an error
    "top_p": (float, 0, 1),
    "top_k": (int, 0, 2**31 - 1),
    "min_p": (float, 0, 1),
    "repeat_penalty": (float, 0, 1e6),
    "seed": (int, 0, 2**32 - 2),
}


def with_setting(settings: ChatSettings, key: str, value: str) -> ChatSettings:
    """settings with one `/set KEY VALUE` applied; ValueError says what is accepted."""
    if key in SETTING_RANGES:
        kind, low, high = SETTING_RANGES[key]
        try:
            number = kind(value)
        except ValueError:
            raise ValueError(f"{key} takes a number, not {value!r}") from None
        if not low <= number <= high:  # NaN too
            most = f"{high:g}" if isinstance(high, float) else str(high)
            raise ValueError(f"{key} takes {low} to {most}, not {value!r}")
        return replace(settings, sampling=replace(settings.sampling, **{key: number}))
    if key == "max_tokens":
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"max_tokens takes a whole number of at least 1, not {value!r}")
        return replace(settings, max_tokens=int(value))
    if key == "stop":
        # Backslash escapes so that a newline can be typed: /set stop \n\n
        stops = tuple(s.encode().decode("unicode_escape") for s in value.split(",") if s)
        return replace(settings, stop=stops)
    raise ValueError(f"unknown setting {key!r}; /set takes {', '.join(RESTORED)}")


RESTORED = (*SETTING_RANGES, "max_tokens", "stop")  # what /set changes and a transcript keeps


def with_settings(settings: ChatSettings, saved: dict[str, Any]) -> ChatSettings:
    """settings with a transcript's saved ones applied, checked as /set checks them."""
    for key, value in saved.items():
        if key != "stop":
            settings = with_setting(settings, key, str(value))
        elif isinstance(value, list) and all(isinstance(stop, str) for stop in value):
            settings = replace(settings, stop=tuple(value))
        else:
            raise TypeError("'stop' is not a list of texts")
    return settings

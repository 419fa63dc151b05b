"""Chat templates: a conversation rendered into the text a model was trained to read.

The model's Jinja template (`tokenizer.chat_template`, or `tokenizer.chat_template.tool_use` when
tools are given) is rendered as transformers' `apply_chat_template` does (a sandboxed immutable
environment, trim_blocks, lstrip_blocks, loop controls, raise_exception, strftime_now, a tojson
that does not escape HTML), bounded in time and size: it is code from a downloaded file.
llama.cpp's C helper renders only where Jinja fails or a family name is all there is.
No llama_cpp at import time: `quill inspect` reads families without loading llama.cpp.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any

from cli.errors import ChatTemplateError, UsageError

# A message: (role, content) as run and chat hold them, or an OpenAI-style dict (tool calls,
# tool results) as the server receives them.
Message = tuple[str, str] | Mapping[str, Any]

# Bounds on one rendering: a template is code shipped inside a downloaded file.
RENDER_SECONDS = 2.0
RENDER_CHARS = 8 << 20
TEMPLATE_FILE_BYTES = 1 << 20  # real chat templates are tens of kilobytes


# The families quill knows (llama.cpp's C helper accepts each name); what each supports is what
# its published templates do. chatml: Qwen, SmolLM, Hermes; llama2: also Mistral v1;
# mistral-v3-tekken: Mistral Nemo; phi3: also Phi-4-mini; deepseek3: V3 and R1.
FAMILIES = ("chatml", "llama3", "gemma", "mistral-v7", "mistral-v3-tekken", "llama2",
            "mistral-v3", "phi3", "phi4", "deepseek3", "gpt-oss")  # fmt: skip


@dataclass(frozen=True)
class ChatTemplate:
    """The template a model's conversations go through, and where it came from."""

    source: str | None  # Jinja text; None where only a family name is known (llama.cpp renders)
    family: str  # one of FAMILIES, "unknown", or a llama.cpp built-in name the user chose
    origin: str  # "the model file", "models.yaml", "inferred", or "the file PATH" the user chose
    named: Mapping[str, str] = field(default_factory=dict)  # e.g. {"tool_use": "..."}

    @property
    def supports_tools(self) -> bool:
        texts = [self.source or "", *self.named.values()]
        return any("tools" in text for text in texts)

    @property
    def thinking_switch(self) -> bool:
        """Whether the template reads enable_thinking (Qwen3, SmolLM3 switch thinking so)."""
        return "enable_thinking" in (self.source or "")

    @property
    def supports_thinking(self) -> bool:
        text = self.source or ""
        return self.thinking_switch or "<think>" in text or "reasoning_content" in text

    def describe(self) -> str:
        what = [f"family {self.family}"]
        what.append("tools" if self.supports_tools else "no tools")
        if self.family == "gpt-oss":
            what.append("reasoning in channels (not split by quill)")
        elif self.thinking_switch:
            what.append("thinking (switchable)")
        elif self.supports_thinking:
            what.append("thinking")
        else:
            what.append("no thinking")
        return ", ".join(what)


# The markers a family's Jinja template writes, checked in this order as llama.cpp's
# llm_chat_detect_template does (all of an entry's space-separated markers must be there).
_TEMPLATE_MARKERS = (
    ("gpt-oss", "<|channel|>"), ("phi4", "<|im_sep|>"), ("chatml", "<|im_start|>"),
    ("llama3", "<|start_header_id|>"), ("gemma", "<start_of_turn>"),
    ("deepseek3", "<｜Assistant｜>"), ("deepseek3", "<｜User｜>"),
    ("phi3", "<|assistant|> <|end|>"), ("mistral-v7", "[SYSTEM_PROMPT]"),
    ("mistral-v3", "[TOOL_CALLS]"), ("mistral-v3", "[AVAILABLE_TOOLS]"), ("llama2", "[INST]"),
)  # fmt: skip


def template_family(source: str) -> str:
    """The family a Jinja template belongs to, by the markers it writes."""
    for family, markers in _TEMPLATE_MARKERS:
        if all(marker in source for marker in markers.split()):
            return family
    return "unknown"


# Special tokens that identify a family in a vocabulary, most specific first.
_FAMILY_TOKENS = (
    ("<|channel|>", "gpt-oss"), ("<|im_sep|>", "phi4"), ("<|start_header_id|>", "llama3"),
    ("<start_of_turn>", "gemma"), ("<｜Assistant｜>", "deepseek3"), ("<|assistant|>", "phi3"),
    ("[SYSTEM_PROMPT]", "mistral-v7"), ("[INST]", "llama2"), ("<|im_start|>", "chatml"),
)  # fmt: skip
_FAMILY_ARCHITECTURES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "phi3": "phi3"}


def infer_family(architecture: str, is_special_token: Callable[[str], bool]) -> str | None:
    """A template-less file's family by its vocabulary's special tokens, else its architecture."""
    for marker, family in _FAMILY_TOKENS:
        if is_special_token(marker):
            return family
    return _FAMILY_ARCHITECTURES.get(architecture)


class _Budget:
    """A deadline and an output cap for one rendering, checked from a trace function: a loop in
    a template runs Python bytecode, so every line it executes passes through here."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.seconds = seconds
        self.ticks = 0

    def trace(self, frame: Any, event: str, arg: Any) -> Callable | None:
        if event == "call":
            # Lines are traced only in the template's own code (Jinja compiles it to Python
            # named "<template>"), where its loops run; library frames cost one call each.
            return self.trace if frame.f_code.co_filename == "<template>" else None
        self.ticks += 1
        if self.ticks & 1023 == 0 and time.monotonic() > self.deadline:
            raise _TooLong(f"rendering took more than {self.seconds:g} s (does it loop?)")
        return self.trace


class _TooLong(Exception):
    pass


@lru_cache(maxsize=1)
def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """transformers' {% generation %} marks assistant text for training masks; a renderer
        outputs its body unchanged."""

        tags = {"generation"}  # noqa: RUF012 (jinja reads it as a class attribute)

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        # `'x' * 10**10` or `9**9**9` would run inside one C call, where no trace reaches.
        intercepted_binops = frozenset(("*", "**"))

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and abs(right) > 4096:
                raise _TooLong(f"the template computes a power of {right}")
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    sized = isinstance(seq, (str, list, tuple)) and isinstance(times, int)
                    if sized and len(seq) * times > RENDER_CHARS:
                        raise _TooLong("the template builds a value past the size limit")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' tojson: no HTML escaping (Jinja's own escapes <, > and &), and the
        # arguments templates pass.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(source: str):
    return _environment().from_string(source)


def _plain(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as the dicts templates index; reasoning under the names templates read."""
    plain = []
    for message in messages:
        if isinstance(message, tuple):
            role, content = message
            plain.append({"role": role, "content": content})
            continue
        item = json.loads(json.dumps(message))  # a private copy: templates may not mutate it
        reasoning = item.get("reasoning_content") or item.get("thinking")
        if reasoning is not None:
            item = {"thinking": reasoning, **item, "reasoning_content": reasoning}
        plain.append(item)
    return plain


def render_jinja(
    source: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    extra: Mapping[str, Any] | None = None,
    seconds: float = RENDER_SECONDS,
    chars: int = RENDER_CHARS,
) -> str:
    """The template's text for a conversation, as transformers' apply_chat_template(tokenize=
    False) gives it. Raises ChatTemplateError naming why a template cannot render."""
    import jinja2

    try:
        template = _compile(source)
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"the chat template does not parse: {error}") from None
    variables = {
        "messages": _plain(messages),
        "tools": json.loads(json.dumps(list(tools))) if tools is not None else None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        **(extra or {}),
    }
    budget = _Budget(seconds)
    pieces: list[str] = []
    size = 0
    previous = sys.gettrace()
    sys.settrace(budget.trace)
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            if size > chars:
                raise _TooLong(f"the rendered prompt passed {chars} characters")
            pieces.append(piece)
    except (_TooLong, RecursionError, MemoryError) as error:
        # MemoryError: one C call asked for it all at once ("{:>99999999999}".format).
        why = {RecursionError: "it recursed too deep", MemoryError: "it built a value larger "
               "than memory"}.get(type(error), error)  # fmt: skip
        raise ChatTemplateError(f"the chat template was stopped: {why}") from None
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"the chat template raised: {error}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as error:
        # ArithmeticError: the sandbox's OverflowError for range(1000000000), 1/0.
        raise ChatTemplateError(
            f"the chat template failed: {type(error).__name__}: {error}"
        ) from None
    finally:
        sys.settrace(previous)
    return "".join(pieces)


def render_with_llama(template: str, messages: Sequence[tuple[str, str]]) -> str | None:
    """llama.cpp's C helper (llama_chat_apply_template): a template it recognises by its markers,
    or a family name. None where it knows neither. Only role and content pass through."""
    import llama_cpp as llama

    array = (llama.llama_chat_message * len(messages))()
    # llama.cpp reads each message as a C string, which ends at a NUL: a stand-in carries it
    # through the template, or everything after it would silently vanish.
    nul = _nul_stand_in(content for _, content in messages)
    keep = [(role.encode(), content.replace("\0", nul).encode()) for role, content in messages]
    for slot, (role, content) in zip(array, keep, strict=True):
        slot.role, slot.content = role, content
    size = 4 * sum(len(c) for _, c in keep) + 1024
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama.llama_chat_apply_template(template.encode(), array, len(keep), True, buf, size)
        if n < 0:
            return None
        if n <= size:
            return buf.raw[:n].decode("utf-8").replace(nul, "\0")
        size = n
    return None


def role_content(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """(role, text) pairs for the C helper, which knows no tool calls: a tool result becomes a
    user turn (as llama-server does for templates without a tool role)."""
    pairs = []
    for message in messages:
        if isinstance(message, tuple):
            pairs.append(message)
            continue
        role = str(message.get("role", "user"))
        content = message.get("content") or ""
        if not isinstance(content, str):
            content = json.dumps(content, ensure_ascii=False)
        if message.get("tool_calls"):
            content += json.dumps(message["tool_calls"], ensure_ascii=False)
        pairs.append(("user" if role == "tool" else role, content))
    return pairs


def _nul_stand_in(texts: Any) -> str:
    """A private-use character that none of the texts holds."""
    seen = set("".join(texts))
    return next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in seen)


@dataclass
class Rendered:
    text: str
    note: str | None = None  # one line to tell the user (a fallback was taken), or None


def render_conversation(
    template: ChatTemplate,
    messages: Sequence[Message],
    *,
    bos_token: str,
    eos_token: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    enable_thinking: bool | None = None,
) -> Rendered:
    """The one path every command's prompt takes: the Jinja template (the tool_use one when
    tools are given and the file has it), else llama.cpp's C helper with one line saying why."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ChatTemplateError("tools must be a list of tool objects")
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    source = template.named.get("tool_use", template.source) if tools else template.source
    if source is None:
        text = render_with_llama(template.family, role_content(messages))
        if text is None:
            raise ChatTemplateError(f"llama.cpp cannot render the {template.family} family")
        return Rendered(text)
    try:
        text = render_jinja(
            source,
            messages,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=tools or None,
            extra=extra,
        )
        if not text:  # nothing to prefill: the model would have no prompt at all
            raise ChatTemplateError("the chat template rendered nothing for this conversation")
        return Rendered(text)
    except ChatTemplateError as error:
        fallback = render_with_llama(source, role_content(messages))
        if fallback is None:
            raise
        return Rendered(fallback, f"{error}; rendered with llama.cpp's built-in template instead")


def file_template(
    meta: Callable[[str], str | None],
    architecture: str,
    is_special_token: Callable[[str], bool],
) -> ChatTemplate | None:
    """The template a model file carries (with its named ones), else the family it points to."""
    source = meta("tokenizer.chat_template")
    named = {n: text for n in ("tool_use", "rag") if (text := meta(f"tokenizer.chat_template.{n}"))}
    if source:
        return ChatTemplate(source, template_family(source), "the model file", named)
    family = infer_family(architecture, is_special_token)
    return ChatTemplate(None, family, "inferred") if family else None


class TemplateNote(str):
    """A line about the template for the user, and which one it is (the commands add the
    options that change it): "fallback", "no thinking switch" or "gpt-oss channels"."""

    kind: str

    def __new__(cls, text: str, kind: str) -> TemplateNote:
        note = super().__new__(cls, text)
        note.kind = kind
        return note


def choose_template(
    own: ChatTemplate | None, chosen: ChatTemplate | None = None, family: str | None = None
) -> tuple[ChatTemplate | None, TemplateNote | None]:
    """The template conversations go through, in quill's one order: a file the user chose,
    else the model file's own, else the family models.yaml names for the model, else the family
    the file's tokens point to (own without a source); and the line that tells the user when it
    is not the file's own (None when it is, or there is none)."""
    if chosen is not None:
        return chosen, None
    if own is not None and own.source is not None:
        return own, None
    template = family_template(family, "models.yaml") if family else own
    if template is None:
        return None, None
    where = "its models.yaml entry names" if family else "its tokens point to"
    text = f"the model file has no chat template; using the {template.family} template {where}"
    return template, TemplateNote(text, "fallback")


def template_notes(template: ChatTemplate | None, think: bool | None) -> list[TemplateNote]:
    """What the user is told about a template's reasoning: gpt-oss's channels stay unsplit, and
    a thinking switch asked of a template that has none changes nothing."""
    notes = []
    if template is not None and template.family == "gpt-oss":
        text = "gpt-oss's channel format is not split into reasoning and answer: both are printed"
        notes.append(TemplateNote(text, "gpt-oss channels"))
    if think is not None and (template is None or not template.thinking_switch):
        notes.append(TemplateNote("the chat template has no thinking switch", "no thinking switch"))
    return notes


def template_from_file(path: str) -> ChatTemplate:
    """A Jinja template file the user chose, read and checked to parse before any model loads."""
    import jinja2

    from cli.userfiles import read_user_text

    too_big = "not a chat template (real ones are tens of kilobytes)"
    source = read_user_text(path, "chat template", TEMPLATE_FILE_BYTES, too_big)
    if not source.strip():
        raise UsageError(f"the chat template {path} is empty: give a Jinja chat template file")
    try:
        _compile(source)
    except jinja2.TemplateError as error:
        raise UsageError(f"the chat template {path} does not parse: {error}") from None
    return ChatTemplate(source, template_family(source), f"the file {path}")


def builtin_template_names() -> list[str]:
    """The template names llama.cpp's C helper renders (llama-server's --chat-template NAME)."""
    import llama_cpp as llama

    names = (ctypes.c_char_p * 256)()
    count = llama.llama_chat_builtin_templates(names, len(names))
    return [(names[i] or b"").decode() for i in range(min(count, len(names)))]


def family_template(family: str, origin: str) -> ChatTemplate:
    if family not in FAMILIES:
        raise UsageError(f"unknown chat template family '{family}' (known: {', '.join(FAMILIES)})")
    return ChatTemplate(None, family, origin)

"""Every error a user can meet, each carrying its exit code, and the one table of exit codes
(each command's --help ends with a sentence made from it); cli/app.py alone turns an error into
a stderr line and its exit code."""

from __future__ import annotations

from cli.units import human_bytes

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_MODEL_NOT_FOUND = 3
EXIT_CONTEXT_OVERFLOW = 4
EXIT_MODEL_LOAD = 5
EXIT_ENDPOINT = 6
EXIT_INVALID_OUTPUT = 7
EXIT_DOES_NOT_FIT = 8
EXIT_RPC = 9
EXIT_INTERRUPTED = 130

# What each exit code means, in the words --help uses.
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success (finish stop or length)",
    EXIT_INTERNAL: "internal error",
    EXIT_USAGE: "usage",
    EXIT_MODEL_NOT_FOUND: "model not found or not obtainable",
    EXIT_CONTEXT_OVERFLOW: "context overflow",
    EXIT_MODEL_LOAD: "model failed to load",
    EXIT_ENDPOINT: "server refused or unreachable",
    EXIT_INVALID_OUTPUT: "output does not match the schema",
    EXIT_DOES_NOT_FIT: "does not fit this machine's memory or disk",
    EXIT_RPC: "RPC server unreachable, refused or lost",
    EXIT_INTERRUPTED: "interrupted",
}

# The codes each command can return: 0, 1, 2 and 130 (Ctrl-C) are everyone's; a command lists
# only the others it raises, so its --help does not promise a schema check it never makes.
_EVERY_COMMAND = (EXIT_OK, EXIT_INTERNAL, EXIT_USAGE)
_MODEL = (EXIT_MODEL_NOT_FOUND, EXIT_MODEL_LOAD)
COMMAND_EXIT_CODES: dict[str, tuple[int, ...]] = {
    "run": (*_MODEL, EXIT_CONTEXT_OVERFLOW, EXIT_ENDPOINT, EXIT_INVALID_OUTPUT, EXIT_RPC),
    "pull": (EXIT_MODEL_NOT_FOUND, EXIT_DOES_NOT_FIT),
    "list": (),
    "rm": (EXIT_MODEL_NOT_FOUND,),
    "inspect": (*_MODEL, EXIT_RPC),
    "quantize": _MODEL,
    "bench": (*_MODEL, EXIT_ENDPOINT, EXIT_DOES_NOT_FIT, EXIT_RPC),
    "chat": (*_MODEL, EXIT_CONTEXT_OVERFLOW, EXIT_ENDPOINT, EXIT_RPC),
    "tokenize": _MODEL,
    "embed": (*_MODEL, EXIT_CONTEXT_OVERFLOW),
    "rerank": (*_MODEL, EXIT_CONTEXT_OVERFLOW),
    "similar": (*_MODEL, EXIT_CONTEXT_OVERFLOW),
    "collections": (),
    "serve": (*_MODEL, EXIT_RPC),
    "rpc-server": (EXIT_RPC,),
    "ps": (EXIT_ENDPOINT,),
    "stop": (EXIT_MODEL_NOT_FOUND, EXIT_ENDPOINT),
    "perplexity": _MODEL,
    "quant-report": _MODEL,
    "cache": (),
    "config": (),
}


def exit_codes_help(command: str) -> str:
    """The sentence that ends a command's --help: the exit codes it can return, in order."""
    codes = sorted({*_EVERY_COMMAND, *COMMAND_EXIT_CODES[command], EXIT_INTERRUPTED})
    meanings = [EXIT_CODES[code] if code or command == "run" else "success" for code in codes]
    return f"Exit codes: {', '.join(f'{c} {m}' for c, m in zip(codes, meanings, strict=True))}."


class QuillError(Exception):
    """An error with a message meant for the user: what went wrong, why, what to do."""

    exit_code = EXIT_INTERNAL


class UsageError(QuillError):
    exit_code = EXIT_USAGE


class ModelNotFoundError(QuillError):
    """The model name does not resolve, or no source could provide the file."""

    exit_code = EXIT_MODEL_NOT_FOUND


class NotOnDiskError(ModelNotFoundError):
    """The model is not on disk, and the caller asked not to download it."""

    def __init__(self, name: str, label: str, why: str = ""):
        self.name, self.label = name, label
        super().__init__(f"{label} is not on disk{why}")


class DiskSpaceError(ModelNotFoundError):
    """Not enough free disk space to download the model."""


class DoesNotFitError(QuillError):
    """A replica that needs more memory or disk than this machine has: refused before anything
    is written (resource: "memory" or "disk"; detail: the plan's parts)."""

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, of: str, resource: str, needs: int, room: int, where: str, detail: str):
        self.of, self.resource, self.needs, self.room, self.where = of, resource, needs, room, where
        super().__init__(
            f"a replica of {of} needs {human_bytes(needs)} of {resource}{detail}, and {where} has "
            f"{human_bytes(room)} available; nothing was written"
        )


class PullDoesNotFitError(QuillError):
    """quill pull refused a model before downloading it: its plan is larger than the memory."""

    exit_code = EXIT_DOES_NOT_FIT

    def __init__(self, label: str, file: str, needs: int, n_ctx: int, where: str, room: int):
        super().__init__(
            f"{label} ({file}) needs {human_bytes(needs)} of memory at a context of {n_ctx}, and "
            f"{where} has {human_bytes(room)}; nothing was downloaded"
        )


class NotOwnedError(UsageError):
    """quill refuses to delete a file it did not download or make."""


class NotOursError(UsageError):
    """A setting a server's model keeps for itself (its threads): quill cannot change it here."""


class RegistryError(UsageError):
    """models.yaml is malformed: the message names the entry and the field."""


class TranscriptError(UsageError):
    """A chat transcript file that cannot be read or written."""


class ChatNotFoundError(UsageError):
    """No saved chat, or several (matches: those whose names start with it), go by name."""

    def __init__(self, name: str, folder: object, matches: list[str]):
        self.name, self.folder, self.matches = name, folder, matches
        shown = repr(name) if len(name) <= 80 else repr(name[:77] + "...")
        if name == "last":
            text = f"no saved chats in {folder}"
        elif not matches:
            text = f"no saved chat {shown} in {folder}"
        else:
            text = f"{shown} matches {len(matches)} chats ({', '.join(matches)})"
        super().__init__(text)


class ChatTemplateError(UsageError):
    """A chat template that cannot render this conversation, and no fallback could."""


class TextTooLongError(QuillError):
    """A text to embed or rerank is longer than the model reads."""

    exit_code = EXIT_CONTEXT_OVERFLOW

    def __init__(self, label: str, tokens: int, n_ctx: int):
        self.tokens, self.n_ctx = tokens, n_ctx
        super().__init__(f"{label} is {tokens} tokens; the model reads at most {n_ctx}")


class ContextOverflowError(QuillError):
    """The prompt and the most tokens asked for do not fit the context window."""

    exit_code = EXIT_CONTEXT_OVERFLOW

    def __init__(self, prompt_tokens: int, max_tokens: int, n_ctx: int, trained_ctx: int):
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.n_ctx, self.trained_ctx = n_ctx, trained_ctx
        super().__init__(
            f"prompt is {prompt_tokens} tokens and the reply may take {max_tokens}, "
            f"{prompt_tokens + max_tokens} in all, but the context window is {n_ctx} tokens "
            f"(the model was trained on {trained_ctx})"
        )


class ChatOverflowError(QuillError):
    """The next chat turn (the whole conversation, or the last message alone) does not fit."""

    exit_code = EXIT_CONTEXT_OVERFLOW

    def __init__(self, tokens: int, room: int, n_ctx: int, whole_conversation: bool):
        self.tokens, self.room, self.n_ctx = tokens, room, n_ctx
        self.whole_conversation = whole_conversation
        if whole_conversation:
            text = f"the conversation needs {tokens + room} tokens with room for a reply"
        else:
            text = f"this message takes {tokens} tokens and a reply needs {room} more"
        super().__init__(f"{text}, but the context holds {n_ctx}")


class ModelLoadError(QuillError):
    """The file exists but llama.cpp cannot load it: not a GGUF, corrupt, unsupported, no memory."""

    exit_code = EXIT_MODEL_LOAD


class SilentLoadError(ModelLoadError):
    """llama.cpp refused the file and logged no error (its full log may say more)."""


class QuantizeRefusedError(UsageError):
    """quant refused to quantize (its QuantizeError, kept as reason, says why)."""

    def __init__(self, reason: Exception):
        self.reason = reason
        super().__init__(str(reason))


class SilentQuantizeError(SilentLoadError):
    """llama.cpp's quantizer failed and logged no reason (its full log may say more)."""


class EndpointError(QuillError):
    """An OpenAI-compatible server refused the request or could not be reached."""

    exit_code = EXIT_ENDPOINT


class RpcError(QuillError):
    """An RPC server (llama.cpp's ggml-rpc) cannot be used: unreachable, another protocol, busy,
    lost, or this build has no RPC (endpoint empty)."""

    exit_code = EXIT_RPC

    def __init__(self, endpoint: str, reason: str):
        self.endpoint, self.reason = endpoint, reason
        super().__init__(f"RPC server {endpoint} {reason}" if endpoint else reason)


class AuthRequiredError(EndpointError):
    """The server answered 401: it wants a bearer token that was not given, or another (a
    refusal by the server, so the endpoint's exit code)."""


class MissingEndpointError(EndpointError):
    """The server answered 404: it lacks the route (/v1/completions), or is no OpenAI API."""

    def __init__(self, url: str, answer: str):
        self.url, self.answer = url, answer
        super().__init__(f"{url} answered 404: {answer}")


class KvCacheTypeError(UsageError):
    """A quantized KV cache type whose blocks of 32 values do not divide the model's heads."""

    def __init__(self, cache_type: str, which: str, head_dim: int):
        self.cache_type, self.which, self.head_dim = cache_type, which, head_dim
        super().__init__(
            f"a {cache_type} {which} cache stores blocks of 32 values, but this model's heads "
            f"have {head_dim}"
        )


class SpecOptionError(UsageError):
    """Speculative decoding cannot take a setting's value (None: the draft model is missing)."""

    def __init__(self, setting: str, value: object, takes: str):
        self.setting, self.value, self.takes = setting, value, takes
        given = "none was given" if value is None else f"not {value!r}"
        super().__init__(f"speculative decoding's {setting} takes {takes}; {given}")


class QueueFullError(QuillError):
    """The server's scheduler has as many requests waiting as it accepts (the server says 429)."""

    def __init__(self, waiting: int):
        self.waiting = waiting
        super().__init__(f"{waiting} requests are already waiting; retry shortly")


class InvalidOutputError(QuillError):
    """The printed reply breaks its schema or grammar (cut short, or a keyword the grammar could
    not enforce): pipelines must not take it as data."""

    exit_code = EXIT_INVALID_OUTPUT


class Interrupted(QuillError):
    """Ctrl-C, with what it leaves behind (a download to resume, a partial result)."""

    exit_code = EXIT_INTERRUPTED


class TextTooShortError(UsageError):
    """Fewer than two windows of tokens: nothing would be scored with enough context."""

    def __init__(self, tokens: int, window: int):
        super().__init__(
            f"the text has {tokens} tokens; scoring windows of {window} needs at least {2 * window}"
        )

"""Errors in the user's words: the lower layers raise typed errors that carry facts, and the
commands alone name the options that change them."""

from __future__ import annotations

from cli.errors import (
    AuthRequiredError,
    ChatNotFoundError,
    ChatOverflowError,
    ContextOverflowError,
    DoesNotFitError,
    KvCacheTypeError,
    NotOnDiskError,
    PullDoesNotFitError,
    QuantizeRefusedError,
    SilentLoadError,
    SilentQuantizeError,
    SpecOptionError,
    TextTooShortError,
)

# The option that fixes an error whose own line says the rest (a subclass before its base).
ADVICE: dict[type[Exception], str] = {
    SilentQuantizeError: ": run with --verbose for llama.cpp's log",
    SilentLoadError: " (run with --verbose)",
    AuthRequiredError: " (pass --api-key or set QUILL_API_KEY)",
    TextTooShortError: ": give a longer text or a smaller --ctx",
    KvCacheTypeError: ": use --kv-type f16 for it",
}


def note_words(note: str) -> str:
    """A line the engine tells (TemplateNote), with the option that changes what it says."""
    from cli.engine.templates import TemplateNote

    if isinstance(note, TemplateNote) and note.kind == "fallback":
        return f"{note} (--chat-template FILE sets another)"
    if isinstance(note, TemplateNote) and note.kind == "no thinking switch":
        return f"{note}: --think/--no-think changes nothing"
    return note


def user_message(error: Exception) -> str:
    """The one line an error is shown as, with the options that fix it where there are some."""
    if isinstance(error, ContextOverflowError):
        hint = f"raise --ctx (up to {error.trained_ctx}, the model's trained context)"
        if error.n_ctx >= error.trained_ctx:
            hint = "the model cannot take a longer --ctx"
        return (
            f"prompt is {error.prompt_tokens} tokens and --max-tokens is {error.max_tokens}, "
            f"{error.prompt_tokens + error.max_tokens} in all, but the context window is "
            f"{error.n_ctx} tokens: {hint}, shorten the input, or lower --max-tokens"
        )
    if isinstance(error, ChatOverflowError) and error.whole_conversation:
        return f"{error}: /clear, or restart with --on-overflow truncate or a larger --ctx"
    if isinstance(error, ChatOverflowError):
        return f"{error}: shorten it or restart with a larger --ctx"
    if isinstance(error, PullDoesNotFitError):
        return f"{error}: pick a smaller quant (OWNER/REPO lists them), lower --ctx, or --force"
    if isinstance(error, DoesNotFitError) and error.resource == "disk":
        return f"{error}: free some space, or set QUILL_HOME to a larger disk"
    if isinstance(error, DoesNotFitError):
        return f"{error}: pick a smaller quant, or lower --depth, -p or -n"
    if isinstance(error, NotOnDiskError):
        return f"{error}; get it with `quill pull {error.name}`"
    if isinstance(error, ChatNotFoundError):
        if error.name == "last":
            return f"{error} to resume"
        if not error.matches:
            return f"{error}: --resume last, or an ID from there"
        return f"--resume {error}; give more of it"
    if isinstance(error, SpecOptionError) and error.value is None:  # the draft model
        return f"--spec draft needs --draft NAME ({error.takes})"
    if isinstance(error, SpecOptionError):
        flag = "--spec" if error.setting == "mode" else "--draft-tokens"
        return f"{flag} takes {error.takes}, not {error.value!r}"
    if isinstance(error, QuantizeRefusedError):
        from quant.quantize import AlreadyQuantizedError, OutputExistsError, OutputNotWritableError

        return str(error) + {
            AlreadyQuantizedError: ": start from an F16/BF16/F32 file (`quill quantize NAME --to "
            "f16` makes one from this one), or pass --allow-requantize to do it anyway",
            OutputExistsError: "; pass --force to replace it",
            OutputNotWritableError: "; choose another place with -o",
        }.get(type(error.reason), "")
    from cli.store.transcripts import NotATranscriptError

    if isinstance(error, NotATranscriptError) and error.continuing:
        return f"{error}; quill will not overwrite it: choose another --transcript"
    if isinstance(error, NotATranscriptError):
        return f"{error}; /save writes one"
    advice = next((words for kind, words in ADVICE.items() if isinstance(error, kind)), "")
    return f"{error}{advice}"

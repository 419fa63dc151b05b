"""Typed errors, each carrying the exit code a command maps it to.

Library code raises these; only command modules turn them into one stderr line and an exit code.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_MODEL_NOT_FOUND = 3
EXIT_CONTEXT_OVERFLOW = 4
EXIT_MODEL_LOAD = 5
EXIT_INTERRUPTED = 130


class QuillError(Exception):
    """An error with a message meant for the user: what went wrong, why, what to do."""

    exit_code = EXIT_INTERNAL


class UsageError(QuillError):
    exit_code = EXIT_USAGE


class ModelNotFoundError(QuillError):
    """The model name does not resolve, or no source could provide the file."""

    exit_code = EXIT_MODEL_NOT_FOUND


class RegistryError(QuillError):
    """models.yaml is malformed: the message names the entry and the field."""

    exit_code = EXIT_USAGE


class ContextOverflowError(QuillError):
    exit_code = EXIT_CONTEXT_OVERFLOW

    def __init__(self, prompt_tokens: int, max_tokens: int, n_ctx: int, trained_ctx: int):
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.n_ctx = n_ctx
        self.trained_ctx = trained_ctx
        needed = prompt_tokens + max_tokens
        hint = f"raise --ctx (up to {trained_ctx}, the model's trained context)"
        if n_ctx >= trained_ctx:
            hint = "the model cannot take a longer --ctx"
        super().__init__(
            f"prompt is {prompt_tokens} tokens and --max-tokens is {max_tokens}, "
            f"{needed} in all, but the context window is {n_ctx} tokens: "
            f"{hint}, shorten the input, or lower --max-tokens"
        )


class ModelLoadError(QuillError):
    """The file exists but llama.cpp cannot load it: not a GGUF, corrupt, unsupported, no memory."""

    exit_code = EXIT_MODEL_LOAD
